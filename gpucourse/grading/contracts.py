"""The contract around a function a learner writes: what any caller relies on besides the result.

A check says what a function must compute. Its contract says what every caller takes for granted on top:

- **inputs unchanged**: the tensors it was given come back bit for bit (after a forward and after a backward);
- **keeps the dtype**: what it returns has its inputs' dtype (bf16 in, bf16 out; float64 in, float64 out);
- **any strides**: an input the caller may pass as a view (a transposed q, a slice) works like a contiguous one.

Each exercise declares its functions' contracts with :class:`Contract`, and its contract checks — checks of
their own, so that a function that breaks only a promise keeps the points its values earn — call the functions
through :func:`call_all`, which runs them on every rank and holds each outcome to its contract. A broken promise
fails alike in every exercise: one line that names the contract, the function, the argument and the shortest way
to see it again (world size, dtype, shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .core import Fail

UNCHANGED, KEEPS_DTYPE, ANY_STRIDES = "inputs unchanged", "keeps the dtype", "any strides"


@dataclass(frozen=True)
class Contract:
    """``function``'s promises: ``args`` names its positional arguments (for the messages), ``unchanged`` those
    that must come back bit for bit, ``dtype_of`` the argument whose dtype every tensor it returns keeps (None: no
    such promise), ``strided`` those a caller may pass with any strides."""

    function: str
    args: tuple[str, ...]
    unchanged: tuple[str, ...] = ()
    dtype_of: str | None = None
    strided: tuple[str, ...] = ()


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


def same_bits(a, b) -> bool:
    """``a`` and ``b`` are tensors of one dtype and shape whose every byte is equal (NaNs and -0.0 included)."""
    if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().flatten().view(torch.uint8),
                       b.detach().contiguous().flatten().view(torch.uint8))


def describe_case(contract: Contract, args: tuple, world_size: int) -> str:
    """The shortest reproduction: world size, the tensors' dtypes and shapes, and which are strided views."""
    tensors = []
    for name, value in zip(contract.args, args):
        if torch.is_tensor(value) and value.dim():
            shape = "×".join(map(str, value.shape))
            tensors.append(f"{name} {shape}{'' if value.is_contiguous() else ' (a strided view)'}")
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in args if torch.is_tensor(v) and v.is_floating_point()})
    return (f"{world_size} rank{'s' * (world_size > 1)}, {'/'.join(dtypes) or 'no floats'}"
            + (f", {', '.join(tensors)}" if tensors else ""))


def _tensors(value) -> list:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def hold(contract: Contract, sent_per_rank: list, outcomes: list) -> None:
    """Raise :class:`Fail` at the first promise of ``contract`` an outcome broke (``sent_per_rank``: the
    arguments each rank was given, as the grader holds them)."""
    n = len(outcomes)
    for sent, o in zip(sent_per_rank, outcomes):
        case = describe_case(contract, tuple(sent), n)
        for name in contract.unchanged:
            i = contract.args.index(name)
            if i < len(sent) and torch.is_tensor(sent[i]) and i < len(o.args) and not same_bits(o.args[i], sent[i]):
                raise Fail(f"contract '{UNCHANGED}': rank {o.rank}'s {contract.function} changed its input {name} "
                           f"({case})")
        if contract.dtype_of is not None:
            want = sent[contract.args.index(contract.dtype_of)].dtype
            for t in _tensors(o.value):
                if t.is_floating_point() and t.dtype != want:
                    raise Fail(f"contract '{KEEPS_DTYPE}': rank {o.rank}'s {contract.function} returned a {t.dtype} "
                               f"tensor for {contract.dtype_of} in {want} ({case})")


def call_all(ctx, contract: Contract, args_per_rank: list, strided: bool = False) -> list:
    """``contract.function`` on every rank (``ctx.call_all``), each outcome held to the contract; with ``strided``
    the arguments named in ``contract.strided`` are passed as strided views of the same values. A rank whose call
    raised on a strided input fails the 'any strides' contract by name."""
    if strided:
        args_per_rank = [tuple(as_strided_view(a) if name in contract.strided and torch.is_tensor(a) else a
                               for name, a in zip(contract.args, args)) + tuple(args[len(contract.args):])
                         for args in args_per_rank]
    try:
        outcomes = ctx.call_all(contract.function, args_per_rank)
    except Exception as e:
        sentence = getattr(e, "sentence", None)  # the learner's code raised (the host's LearnerError)
        if not strided or sentence is None:
            raise
        case = describe_case(contract, tuple(args_per_rank[0]), len(args_per_rank))
        raise Fail(f"contract '{ANY_STRIDES}': {contract.function} raised on inputs passed as views ({case}): "
                   f"{sentence}") from None
    hold(contract, args_per_rank, outcomes)
    return outcomes


def call(ctx, contract: Contract, *args, strided: bool = False):
    """:func:`call_all` on the one rank of a local check; its Outcome."""
    return call_all(ctx, contract, [args], strided)[0]
