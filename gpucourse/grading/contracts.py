"""The contract around a function a learner writes: what any caller relies on besides the result.

A check says what a function must compute. Its contract says what every caller takes for granted on top:

- **inputs unchanged**: the tensors it was given come back bit for bit (after a forward and after a backward), and
  the lists and numbers it was given (a block table, expert counts) as they were, of the same types;
- **keeps the dtype**: what it returns has its inputs' dtype (bf16 in, bf16 out; float64 in, float64 out);
- **any strides**: an input the caller may pass as a view (a transposed q, a slice) works like a contiguous one;
- **a new tensor**: what it returns is a tensor of its own, not the caller's tensor nor a view of it.

A function's inputs may be tensors or lists of them (a list of gradients). A function the grader cannot call by
itself (a layer's forward, an optimizer's step) is driven by a probe (:func:`probe_all`), which reports the
function's arguments after each moment of the call (after forward, after backward). What a function writes into
tensors it was given cannot change their dtype, but it can lose their precision: :func:`expect_precision` holds
a float64 result to float64's rounding.

Each exercise declares its functions' contracts with :class:`Contract`, and its contract checks — checks of
their own, so that a function that breaks only a promise keeps the points its values earn — call the functions
through :func:`call_all`, which runs them on every rank and holds each outcome to its contract. A broken promise
fails alike in every exercise: one line that names the contract, the function, the argument and the shortest way
to see it again (world size, dtype, shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import Fail, Outcome, describe_mismatch

UNCHANGED, KEEPS_DTYPE, ANY_STRIDES, NEW_TENSOR = "inputs unchanged", "keeps the dtype", "any strides", "a new tensor"


@dataclass(frozen=True)
class Contract:
    """``function``'s promises: ``args`` names its positional arguments (for the messages), ``unchanged`` those
    that must come back bit for bit, ``dtype_of`` the argument whose dtype every tensor it returns keeps (None: no
    such promise), ``strided`` those a caller may pass with any strides, ``fresh`` that what it returns shares no
    memory with its arguments."""

    function: str
    args: tuple[str, ...]
    unchanged: tuple[str, ...] = ()
    dtype_of: str | None = None
    strided: tuple[str, ...] = ()
    fresh: bool = False


def as_strided_view(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t``, laid out as a caller's transpose leaves them: its dimensions stored in reverse
    order (a 1-D tensor: every other element of a larger buffer). A contiguous-only path refuses it (``irecv``
    into a buffer made like it, ``.view`` of it), and ``empty_like`` copies its strides."""
    if t.dim() == 0:
        return t
    if t.dim() == 1:
        return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    order = tuple(range(t.dim() - 1, -1, -1))
    return t.permute(order).contiguous().permute(order)


def _views(value):
    """``value`` with every tensor in it (a tensor, or a list or tuple of them) passed as a strided view."""
    if torch.is_tensor(value):
        return as_strided_view(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_views(v) for v in value)
    return value


def same_bits(a, b) -> bool:
    """``a`` and ``b`` are tensors of one dtype and shape whose every byte is equal (NaNs and -0.0 included)."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().flatten().view(torch.uint8),
                       b.detach().contiguous().flatten().view(torch.uint8))


def _same(a, b) -> bool:
    """:func:`same_bits` for tensors, and for lists, tuples and dicts of them, element by element."""
    if torch.is_tensor(b):
        return same_bits(a, b)
    if isinstance(b, (tuple, list)):
        return isinstance(a, (tuple, list)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(b, dict):
        return isinstance(a, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    # Plain data (a block table, a count): the same value of the same type, so that tensor(4) is not 4.
    return type(a) is type(b) and (a == b or (a != a and b != b))


def _shape(t: torch.Tensor) -> str:
    return "×".join(map(str, t.shape)) or "0-d"


def describe_case(contract: Contract, args: tuple, world_size: int) -> str:
    """The shortest reproduction: world size, the tensors' dtypes and shapes, and which are strided views."""
    tensors = []
    for name, value in zip(contract.args, args):
        if torch.is_tensor(value) and value.dim():
            shape = "×".join(map(str, value.shape))
            tensors.append(f"{name} {shape}{'' if value.is_contiguous() else ' (a strided view)'}")
        elif isinstance(value, (tuple, list)) and value and all(torch.is_tensor(v) for v in value):
            views = " (strided views)" if any(not v.is_contiguous() for v in value) else ""
            tensors.append(f"{name} [{', '.join(map(_shape, value))}]{views}")
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for v in args[:len(contract.args)] for t in _tensors(v)
                     if t.is_floating_point()})
    return (f"{world_size} rank{'s' * (world_size > 1)}, {'/'.join(dtypes) or 'no floats'}"
            + (f", {', '.join(tensors)}" if tensors else ""))


def _plain_words(value) -> str:
    """A list or number the caller passed, as it came back: its repr, tensors in it named as such."""
    if torch.is_tensor(value):
        return f"tensor({value.tolist()})" if value.numel() <= 8 else f"a tensor of shape {_shape(value)}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(map(_plain_words, value))
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def hold(contract: Contract, sent_per_rank: list, outcomes: list, when: str = "") -> None:
    """Raise :class:`Fail` at the first promise of ``contract`` an outcome broke (``sent_per_rank``: the
    arguments each rank was given, as the grader holds them; ``when``: the moment the outcomes' arguments were
    seen, for the message, such as " in backward")."""
    n = len(outcomes)
    for sent, o in zip(sent_per_rank, outcomes):
        case = describe_case(contract, tuple(sent), n)
        for name in contract.unchanged:
            i = contract.args.index(name)
            if i < len(sent) and i < len(o.args) and not _same(o.args[i], sent[i]):
                seen = "" if _tensors(sent[i]) else f": {sent[i]!r} became {_plain_words(o.args[i])}"
                raise Fail(f"contract '{UNCHANGED}': rank {o.rank}'s {contract.function} changed its input {name}"
                           f"{when}{seen} ({case})")
        if contract.fresh and o.aliases is not None:
            name = contract.args[o.aliases] if o.aliases < len(contract.args) else f"argument {o.aliases}"
            raise Fail(f"contract '{NEW_TENSOR}': rank {o.rank}'s {contract.function} returned a tensor that shares "
                       f"its memory with its input {name}: the caller's tensor, not a new one ({case})")
        if contract.dtype_of is not None:
            want = sent[contract.args.index(contract.dtype_of)].dtype
            for t in _tensors(o.value):
                if t.is_floating_point() and t.dtype != want:
                    raise Fail(f"contract '{KEEPS_DTYPE}': rank {o.rank}'s {contract.function} returned a {t.dtype} "
                               f"tensor for {contract.dtype_of} in {want} ({case})")


def _as_views(contract: Contract, args_per_rank: list) -> list:
    return [tuple(_views(a) if name in contract.strided else a for name, a in zip(contract.args, args))
            + tuple(args[len(contract.args):]) for args in args_per_rank]


def _run(ctx, contract: Contract, run, args_per_rank: list, strided: bool) -> list:
    """``run(args_per_rank)``; a rank that raised on strided inputs fails the 'any strides' contract by name."""
    try:
        return run(args_per_rank)
    except Exception as e:
        sentence = getattr(e, "sentence", None)  # the learner's code raised (the host's LearnerError)
        if not strided or sentence is None:
            raise
        case = describe_case(contract, tuple(args_per_rank[0]), len(args_per_rank))
        raise Fail(f"contract '{ANY_STRIDES}': {contract.function} raised on inputs passed as views ({case}): "
                   f"{sentence}") from None


def call_all(ctx, contract: Contract, args_per_rank: list, strided: bool = False) -> list:
    """``contract.function`` on every rank (``ctx.call_all``), each outcome held to the contract; with ``strided``
    the arguments named in ``contract.strided`` are passed as strided views of the same values. A rank whose call
    raised on a strided input fails the 'any strides' contract by name."""
    if strided:
        args_per_rank = _as_views(contract, args_per_rank)
    outcomes = _run(ctx, contract, lambda args: ctx.call_all(contract.function, args), args_per_rank, strided)
    hold(contract, args_per_rank, outcomes)
    return outcomes


def call(ctx, contract: Contract, *args, strided: bool = False):
    """:func:`call_all` on the one rank of a local check; its Outcome."""
    return call_all(ctx, contract, [args], strided)[0]


def probe_all(ctx, contract: Contract, probe: str, args_per_rank: list, strided: bool = False) -> list:
    """:func:`call_all` for a function that a probe drives (``ctx.probe_all(probe, ...)``): a layer's forward and
    backward, an optimizer's step. The probe's arguments begin with the ones ``contract.args`` names, those the
    function is handed (its own follow); its report, a dict, holds under ``"contract"`` what the function returned
    (``"value"``) and those arguments as they were after each moment of the call (``"after"``: {"forward": (x,),
    "backward": (x,)}), each held to the contract. The Outcomes, with the probe's reports as their values."""
    if strided:
        args_per_rank = _as_views(contract, args_per_rank)
    outcomes = _run(ctx, contract, lambda args: ctx.probe_all(probe, args), args_per_rank, strided)
    held = [o.value.get("contract", {}) if isinstance(o.value, dict) else {} for o in outcomes]
    moments = list(held[0].get("after", {})) if held else []
    for k, moment in enumerate(moments or [None]):
        seen = [Outcome(o.rank, h.get("value"), tuple(h["after"][moment]) if moment else (), None, o.comm, o.time_s)
                for o, h in zip(outcomes, held)]
        hold(contract, args_per_rank, seen, f" in {moment}" if k else "")
    return outcomes


def probe(ctx, contract: Contract, name: str, *args, strided: bool = False):
    """:func:`probe_all` on the one rank of a local check; its Outcome."""
    return probe_all(ctx, contract, name, [args], strided)[0]


def expect_precision(contract: Contract, what: str, got, want: torch.Tensor, case: str, atol: float = 1e-5,
                     rtol: float = 1e-4) -> None:
    """'keeps the dtype' for what a function writes into tensors it was given (an optimizer's weights, gradients
    averaged in place): their dtype cannot change, but a value that passed through a tensor of a narrower dtype
    (one made without ``dtype=``, so float32) keeps only that dtype's precision. Fail unless ``got`` equals
    ``want`` (in float64) to the values' tolerance (``atol``, ``rtol``; else the values are wrong, and said so),
    then to float64's rounding (else the contract is broken)."""
    if torch.is_tensor(got) and got.is_floating_point() and got.dtype != want.dtype:
        raise Fail(f"contract '{KEEPS_DTYPE}': {contract.function} left {what} in {got.dtype}, for inputs in "
                   f"{want.dtype} ({case})")
    problem = describe_mismatch(what, got, want, atol, rtol)
    if problem:
        raise Fail(f"{problem} ({case})")
    if not torch.allclose(got, want, atol=1e-12, rtol=1e-10):
        raise Fail(f"contract '{KEEPS_DTYPE}': {contract.function} left {what} {float((got - want).abs().max()):.1g} "
                   f"away from the {str(want.dtype).removeprefix('torch.')} result, float32's rounding: it passed "
                   f"through a float32 tensor (one made without dtype=) ({case})")
