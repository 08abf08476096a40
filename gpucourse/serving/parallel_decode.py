"""Parallel decode: the training strategies serve tokens, and every layout makes exactly the single-device tokens.

A decode step feeds every running sequence its newest token and gets one row of logits back for each. A layout
changes where the weights and the KV cache live, and so what crosses the wire for each generated token. Below, B is
the number of sequences decoding together, C = n_embd, L = n_layer, e the bytes of one number (4 in fp32); "sent"
is what all ranks together send, as ``gpucourse.comm`` counts it (an all-reduce over n ranks by the ring algorithm:
each rank sends 2(n − 1)/n of the tensor; a send: the tensor, once).

**Tensor parallel** (``tp``). Each rank holds 1/tp of every block's q, k, v and MLP-in (columns) and of both
output projections (rows): ``apply_tensor_parallel`` from training, unchanged, or DTensor's
``apply_dtensor_parallel``. Embeddings, norms and the head stay whole. A rank holds whole attention heads, n_head/tp
of them, so its KV cache holds those heads only: the cache is cut by tp as the weights are. Attention and MLP each
end in an all-reduce of the new tokens' (B, 1, C) activations, which hands every rank the same sum, so every rank
computes the same logits and picks the same token. Sent per generated token: 2 · L all-reduces of C numbers,
4 · (tp − 1) · L · C · e bytes. With grouped-query attention (fewer KV heads than query heads, as
Llama-2-70B's 8 for 64), a rank caches the KV heads its query heads read: n_kv/tp of them while tp ≤ n_kv; past
that each KV head is replicated on tp/n_kv ranks and the cache stops shrinking at one head a rank
(:func:`kv_heads_per_rank`). This course's model has one KV head per query head.

**Pipeline parallel** (``pp``). Each rank holds a stage: consecutive blocks, cut as training cuts them
(``pipeline.GPTStage``), the first stage also the embeddings, the last the final norm and head; each stage's KV
cache holds its own blocks only. The requests are cut into m microbatches. Stage s sends each microbatch's hidden
state to stage s + 1; the last stage picks the next tokens and sends their ids back to the first, which feeds them
in (and streams them to whoever asked). Sent per generated token: (pp − 1) · C · e + 8 (an int64 token id).
*Latency*: a token passes every stage in turn, and the next cannot start before it is chosen, so the time per
output token is the sum of the stages' times (plus the hops) — pipelining makes no sequence faster. *Throughput*:
while stage 1 works on microbatch 0, stage 0 works on microbatch 1; with m ≥ pp microbatches in flight every
stage is busy, and each holds only 1/pp of the weights.

**Data parallel** (``dp``). Each rank holds the whole model and serves its own share of the requests with its own
KV cache. Sent per generated token: 0. Throughput grows with the replicas; latency is one device's.

**Expert parallel** (``ep``). As dp, each rank serves its share of the requests with attention and routers
replicated, but every mixture-of-experts block's E experts are spread, E/ep a rank (``apply_expert_parallel``, the
training all-to-all unchanged). In each MoE block a step first all-to-alls the E counts, then sends every token
choice routed to another rank's expert there and back. Sent per step: per MoE block (ep − 1) · E · 8 for the
counts, plus 2 · C · e per token choice routed away; per generated token, that over B — on a uniform router about
2 · top_k · (ep − 1)/ep · C · e per MoE block.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..measure import Recorder
from ..model import GPT, MoE, build_model
from ..parallel.expert_parallel import apply_expert_parallel
from ..parallel.pipeline import GPTStage
from ..parallel.tensor_parallel import apply_tensor_parallel
from ..parallel.tensor_parallel_torch import apply_dtensor_parallel
from ..readable import ConfigError
from ..runtime import current, launch
from .kv_cache import KVCache, check_prompts, generate, inference, next_token

KINDS = ("tp", "pp", "dp", "ep")


@dataclass(frozen=True)
class Layout:
    """``kind`` (tp, pp, dp or ep) over ``n`` ranks. ``impl="torch"``: DTensor's tensor parallelism (tp only).
    ``microbatches`` (pp only): how many groups of requests flow through the stages together."""

    kind: str
    n: int
    impl: str = "scratch"
    microbatches: int = 2

    def __str__(self) -> str:
        return f"{self.kind}{self.n}" + ("-torch" if self.impl == "torch" else "")


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """The KV heads a tensor-parallel rank caches: kv_heads/tp, or one (replicated) when there are fewer than tp."""
    if kv_heads % tp and tp % kv_heads:
        raise ConfigError(f"tp={tp} and {kv_heads} KV heads must divide one another: each rank caches whole "
                          f"KV heads, or one KV head shared with tp/kv_heads ranks.")
    return max(1, kv_heads // tp)


def check(cfg, layout: Layout, prompts: list[list[int]], new_tokens: int) -> None:
    """Refuse, in one sentence and before any rank starts, what ``layout`` cannot serve for model ``cfg``."""
    kind, n, E, B = layout.kind, layout.n, cfg.moe_experts, len(prompts)
    if kind not in KINDS or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"layout {kind!r} over {n!r} ranks: the kind is one of {', '.join(KINDS)}, the ranks "
                          f"a whole number, at least 1.")
    check_prompts(cfg, prompts, new_tokens)
    rules = [  # (broken, the sentence that says so), in the order they are looked at
        (layout.impl not in ("scratch", "torch") or (layout.impl == "torch" and kind != "tp"),
         f"impl={layout.impl!r} with {kind}: 'torch' (DTensor) is for tp; every layout runs impl='scratch'."),
        (kind == "tp" and cfg.n_head % n, f"tp={n} must divide n_head={cfg.n_head}: each rank holds whole "
                                          f"attention heads and their share of the KV cache."),
        (kind == "tp" and 4 * cfg.n_embd % n, f"tp={n} must divide the MLP width 4 × n_embd = {4 * cfg.n_embd}."),
        (kind == "tp" and layout.impl == "torch" and E, "tp with impl='torch' cuts dense MLPs (mlp.fc, mlp.proj); "
                                                        "a mixture of experts runs tp with impl='scratch'."),
        (kind != "tp" and cfg.moe_capacity, f"moe_capacity drops token choices by what each forward holds, which "
                                            f"{kind} changes: serve with moe_capacity=0."),
        (kind == "pp" and n > cfg.n_layer, f"pp={n} needs a block for every stage; the model has "
                                           f"n_layer={cfg.n_layer}."),
        (kind == "pp" and not 1 <= layout.microbatches <= B,
         f"microbatches={layout.microbatches} must be between 1 and the {B} requests."),
        (kind in ("dp", "ep") and n > B, f"{kind}={n} gives each replica its own requests; there are only {B}."),
        (kind == "ep" and not E, f"ep={n} spreads the experts of a mixture of experts; this model has none "
                                 f"(moe_experts=0)."),
        (kind == "ep" and E and E % n, f"ep={n} must divide moe_experts={E}: each rank holds E/ep experts of "
                                       f"every mixture-of-experts block."),
    ]
    for broken, sentence in rules:
        if broken:
            raise ConfigError(sentence)


def step_bytes(layout: Layout, cfg, batch: int, elem: int = 4, away: int = 0) -> float:
    """Bytes all ranks together send in one decode step of ``batch`` sequences (the formulas above);
    ``away`` (ep): token choices routed to another rank's expert, over every MoE block and rank."""
    n, C = layout.n, cfg.n_embd
    if layout.kind == "tp":
        return batch * 4 * (n - 1) * cfg.n_layer * C * elem
    if layout.kind == "pp":
        return batch * ((n - 1) * C * elem + 8)
    if layout.kind == "ep":
        moe_blocks = sum(cfg.is_moe(i) for i in range(cfg.n_layer))
        return moe_blocks * (n - 1) * cfg.moe_experts * 8 + 2 * C * elem * away
    return 0


def share(total: int, parts: int, i: int) -> range:
    """Part ``i`` of ``range(total)`` cut into ``parts`` contiguous pieces whose sizes differ by at most one."""
    return range(i * total // parts, (i + 1) * total // parts)


def decode(model: GPT, layout: Layout, prompts: list[list[int]], new_tokens: int, group=None,
           rec: Recorder | None = None) -> torch.Tensor | None:
    """This rank's part of greedy decoding: ``model`` (the whole GPT, built alike on every rank) becomes this rank's
    part of ``layout`` over ``group`` (all ranks by default). Returns the (B, new_tokens) tokens — on every rank,
    but under pp on the first and last stage only (None elsewhere). ``rec``: its step is set to each step's
    number (0: the prefill), so that :mod:`gpucourse.comm` counts each step's bytes apart."""
    group = group or dist.group.WORLD
    if layout.kind == "pp":
        return pipeline_decode(GPTStage(model, dist.get_rank(group), layout.n), model.cfg, group, prompts,
                               new_tokens, layout.microbatches, rec)
    rank, heads, rows = dist.get_rank(group), None, range(len(prompts))
    counting = contextlib.nullcontext()
    if layout.kind == "tp" and layout.impl == "torch":
        from torch.distributed.device_mesh import DeviceMesh

        apply_dtensor_parallel(model, DeviceMesh.from_group(group, next(model.parameters()).device.type))
        counting = comm.counting()  # DTensor's collectives are not ours: counted where torch dispatches them
    elif layout.kind == "tp":
        apply_tensor_parallel(model, group)
    else:  # dp and ep: this rank's requests; ep also keeps its E/ep experts and sends tokens to the others
        rows = share(len(prompts), layout.n, rank)
        if layout.kind == "ep":
            apply_expert_parallel(model, group, None)
    if layout.kind == "tp":
        heads = kv_heads_per_rank(model.cfg.n_head, layout.n)
    steps = iter(range(new_tokens))  # generate runs the model once a step

    def count_step(*_):  # a pre-hook that returns anything but None replaces the model's input: return nothing
        if rec is not None:
            rec.step = next(steps)

    hook = model.register_forward_pre_hook(count_step)
    with counting:
        tokens = generate(model, [prompts[r] for r in rows], new_tokens, heads=heads)
    hook.remove()
    if layout.kind in ("dp", "ep"):  # the answers, gathered once at the end: not per-token traffic
        parts = [None] * layout.n
        dist.all_gather_object(parts, tokens.cpu(), group=group)
        tokens = torch.cat(parts).to(tokens.device)
    return tokens


class StageRun:
    """A pipeline stage called as a cache calls a model, ``(x, cache=...)``: token ids (first stage) or hidden
    states in, logits (last stage) or hidden states out; the whole output is kept to send on."""

    def __init__(self, stage: GPTStage):
        self.stage, self.out = stage, None

    def __call__(self, x: torch.Tensor, cache) -> torch.Tensor:
        stage = self.stage
        if stage.first:
            x = GPT.embed(stage, x, cache.positions)
        for j, block in enumerate(stage.blocks.values()):  # the stage's cache numbers its own blocks 0, 1, ...
            x = block(x, cache=cache.layer(j))
        self.out = GPT.logits(stage, x) if stage.last else x
        return self.out


def pipeline_decode(stage: GPTStage, cfg, group, prompts: list[list[int]], new_tokens: int, microbatches: int,
                    rec: Recorder | None = None) -> torch.Tensor | None:
    """Greedy decoding through the stages of model ``cfg``, ``microbatches`` groups of requests in flight: each
    step, every group passes every stage. Returns the tokens on the first and the last stage, None elsewhere."""
    s, pp = dist.get_rank(group), dist.get_world_size(group)
    first_rank, last_rank = dist.get_global_rank(group, 0), dist.get_global_rank(group, pp - 1)
    before, after = (dist.get_global_rank(group, s + d) if 0 <= s + d < pp else None for d in (-1, 1))
    weight = next(stage.parameters())
    forward, groups = StageRun(stage), [share(len(prompts), microbatches, i) for i in range(microbatches)]
    held = dataclasses.replace(cfg, n_layer=len(stage.blocks))  # this stage's cache: its own blocks only
    tokens = torch.zeros(len(prompts), new_tokens, dtype=torch.long, device=weight.device)
    fed, caches, sends = [], [], []
    for rows in groups:
        lengths = torch.tensor([len(prompts[r]) for r in rows], device=weight.device)
        idx = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long, device=weight.device)
        for j, r in enumerate(rows):
            idx[j, :len(prompts[r])] = torch.tensor(prompts[r])
        fed.append((idx, lengths))
        caches.append(KVCache(held, len(rows), idx.shape[1] + new_tokens, None, weight.dtype, weight.device))

    def home(i: int, k: int) -> None:  # the first stage receives microbatch i's tokens of step k
        if not stage.last:
            got = torch.empty(len(groups[i]), dtype=torch.long, device=weight.device)
            comm.recv(got, last_rank, group=group, name="recv token ids")
            tokens[groups[i].start:groups[i].stop, k] = got

    with inference(stage):
        for k in range(new_tokens):
            if rec is not None:
                rec.step = k
            for i, rows in enumerate(groups):
                mine = tokens[rows.start:rows.stop]
                if k == 0:
                    idx, counts = fed[i]
                else:
                    if stage.first:
                        home(i, k - 1)
                    idx, counts = mine[:, k - 1:k], torch.ones_like(fed[i][1])
                x = idx
                if not stage.first:  # every stage knows the prompts, so the hidden state's shape needs no message
                    x = torch.empty(*idx.shape, cfg.n_embd, dtype=weight.dtype, device=weight.device)
                    comm.recv(x, before, group=group, name="recv hidden state")
                logits = caches[i].feed_rows(forward, x, counts)
                if stage.last:
                    out, to = next_token(logits), first_rank
                    mine[:, k] = out
                else:
                    out, to = forward.out, after
                if to != dist.get_rank():  # (pp=1 sends nothing) a send overlaps the next microbatch's work
                    sends.append((comm.isend(out, to, group=group, name="send on"), out))
            for handle, _ in sends:
                handle.wait()
            sends.clear()
        if stage.first:
            for i in range(len(groups)):
                home(i, new_tokens - 1)
    return tokens if stage.first or stage.last else None


# --- running the layouts -----------------------------------------------------------------------------------------

def routed_away(model) -> int:
    """Token choices ``model``'s MoE blocks routed to experts this rank does not hold, by the routers' own count,
    since the last call (it resets their counts)."""
    away = 0
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        held = {int(name) for name, _ in moe.experts.named_children()}
        away += sum(int(n) for e, n in enumerate(moe.tokens) if e not in held)
        moe.reset_stats()
    return away


def decode_worker(cases, prompts: list[list[int]], new_tokens: int, seed: int, dtype: str) -> list[dict]:
    """Rank function of :func:`run`: each (model config, layout) in turn, on a model built afresh from ``seed``;
    per case the tokens this rank holds, and per step the bytes it sent and the token choices it routed away."""
    ctx, results = current(), []
    for cfg, layout in cases:
        model = build_model(cfg, seed).to(ctx.device, getattr(torch, dtype))
        rec, sent, away = Recorder(ctx.rank, ctx.device, enabled=False), {}, {}
        model.register_forward_hook(lambda *_: away.__setitem__(rec.step, routed_away(model)))
        comm.set_recorder(rec)
        try:
            tokens = decode(model, layout, prompts, new_tokens, rec=rec)
        finally:
            comm.set_recorder(None)
        for (step, _), (_, bus_bytes, _) in rec.comm.items():
            sent[step] = sent.get(step, 0) + bus_bytes
        results.append({"tokens": None if tokens is None else tokens.tolist(), "sent": sent, "away": away})
    return results


def run(cases, prompts: list[list[int]], new_tokens: int, seed: int = 0, dtype: str = "float32",
        timeout: float = 120.0, quiet: bool = False) -> list[dict]:
    """Greedy-decode ``prompts`` under each ``(model config, Layout)`` of ``cases``, in one launch on the layouts'
    ranks (one number for all), every case checked before any rank starts. Per case: ``tokens`` (B lists of
    new_tokens), and per step (0: the prefill) ``sent``, the bytes all ranks sent, and ``away`` (ep), the token
    choices routed to another rank's experts."""
    sizes = sorted({layout.n for _, layout in cases})
    if len(sizes) != 1:
        raise ConfigError(f"the layouts of one run share its ranks, so they need one size; got {sizes}.")
    for cfg, layout in cases:
        check(cfg, layout, prompts, new_tokens)
    per_rank = launch(decode_worker, cases, prompts, new_tokens, seed, dtype, world_size=sizes[0],
                      timeout=timeout, quiet=quiet)
    return [{"tokens": per_rank[0][c]["tokens"],  # rank 0 takes the requests, so it holds every answer
             **{key: [sum(r[c][key].get(k, 0) for r in per_rank) for k in range(new_tokens)]
                for key in ("sent", "away")}} for c in range(len(cases))]
