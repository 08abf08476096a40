"""Figures of memory: what ZeRO, sequence parallelism and recomputation keep, and the most a fully sharded step
holds, measured against their formulas and the estimate."""

from __future__ import annotations

from ..readable import human_bytes
from ..train import run
from ..course.readings import Reading, figure, ratio
from .harness import RANKS, RUN_TIMEOUT_S, bench_config, memory_ratios, worst_ratio


@figure("zero_memory_vs_formula", target="== 1.0", quick=dict(), full=dict())
def zero_memory_vs_formula() -> Reading:
    """Measured weights, gradients and optimizer bytes per rank of scratch ZeRO-1/2 over the ZeRO formula."""
    from ..modeled.memory import num_params
    from ..parallel.zero import memory_formula

    n = num_params(bench_config().model_config())
    configs = [bench_config(impl="scratch", dp=d, zero=z, batch_size=12, steps=1) for d in (2, 3) for z in (1, 2)]
    ratios = memory_ratios(configs, lambda cfg, rank: memory_formula(n, cfg.dp, cfg.zero))
    worst = worst_ratio(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/formula ratio {worst:.6f} over {len(ratios)}")


@figure("zero3_memory_vs_formula", target="== 1.0", quick=dict(), full=dict())
def zero3_memory_vs_formula() -> Reading:
    """Measured weights, gradients, optimizer state and peak gathered bytes of scratch ZeRO-3 over its formula."""
    from ..modeled.memory import stage_units
    from ..parallel.zero3 import memory_formula

    configs = [bench_config(impl="scratch", dp=d, zero=3, batch_size=12, steps=1, **kw)
               for d, kw in ((2, {}), (3, {}), (2, dict(tp=2)))]
    ratios = {}
    for cfg in configs:
        result = run(cfg, timeout=RUN_TIMEOUT_S, quiet=True)
        want = memory_formula(stage_units(cfg.model_config(), 1, 0, cfg.tp), cfg.dp)
        for rank, mem in result.memory.items():
            for k in ("weights", "gradients", "optimizer"):
                ratios[f"{cfg.layout()} rank{rank} {k}"] = mem[k] / want[k]
        ratios[f"{cfg.layout()} gathered"] = result.extras["zero"]["gathered_peak_bytes"] / want["gathered"]
    worst = worst_ratio(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/formula ratio {worst:.6f} over {len(ratios)}")


@figure("sp_activation_ratio", target="== 0.5", quick=dict(), full=dict())
def sp_activation_ratio() -> Reading:
    """What the blocks' LayerNorms save per rank with sequence parallelism over without, tp = 2 (1/tp exactly)."""
    saved = {}
    for sp in (False, True):
        result = run(bench_config(impl="scratch", dp=1, tp=RANKS, steps=1, sequence_parallel=sp),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        saved[sp] = result.extras["activations_by_region"]["block layernorms"]
    return Reading(ratio(saved[True], saved[False]), {"tp_bytes": saved[False], "sp_bytes": saved[True]},
                   f"{human_bytes(saved[True])} with sequence parallelism, {human_bytes(saved[False])} without")


@figure("memory_estimate_vs_measured", target="== 1.0", quick=dict(), full=dict())
def memory_estimate_vs_measured() -> Reading:
    """Measured weights, gradients and optimizer bytes over ``gpucourse memory``'s estimate, several layouts."""
    from ..modeled.memory import estimate

    configs = [bench_config(impl="scratch", steps=1, **kw) for kw in
               (dict(dp=1), dict(dp=2), dict(dp=2, zero=2), dict(dp=1, tp=2), dict(dp=1, pp=2, microbatches=2))]
    ratios = memory_ratios(configs, lambda cfg, rank: estimate(cfg)["per_rank"][rank])
    worst = worst_ratio(ratios)
    return Reading(worst, {"ratios": ratios}, f"worst measured/estimated ratio {worst:.6f} over {len(ratios)}")


def fsdp_module_peaks(shapes, steps: int) -> list[dict]:
    """On this rank, for each (sequences, tokens) of ``shapes``: the tiny GPT trained ``steps`` steps through
    :class:`~gpucourse.parallel.FullyShardedDataParallel` with Adam in a plain loop, on this rank's sequences; the
    most memory its last step held (:func:`gpucourse.profiling.peak_memory`; the first step makes Adam's moments)."""
    import torch
    import torch.distributed as dist

    from .. import profiling
    from ..model import GPT, MODELS, loss_fn
    from ..parallel import FullyShardedDataParallel
    from ..runtime import current

    device, peaks = current().device, []
    for sequences, tokens in shapes:
        data = torch.Generator().manual_seed(dist.get_rank())
        x, y = (torch.randint(0, MODELS["tiny"].vocab_size, (sequences, tokens), generator=data).to(device)
                for _ in range(2))
        torch.manual_seed(0)
        fsdp = FullyShardedDataParallel(GPT(MODELS["tiny"]).to(device))
        opt = torch.optim.Adam(fsdp.parameters(), lr=1e-3)

        def step():
            loss_fn(fsdp(x), y).backward()
            fsdp.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()

        for _ in range(steps - 1):
            step()
        peaks.append(profiling.peak_memory(step, fsdp, opt, x, y, device=device))
    return peaks


def fsdp_estimate_config(sequences: int, tokens: int, world: int = RANKS):
    """The layout :func:`fsdp_module_peaks` trains, as ``gpucourse memory`` reads one: the tiny GPT, ZeRO-3 with
    each parameter sharded on its own (FSDP2's padding, ``impl="torch"``), fp32, ``sequences`` a rank."""
    return bench_config(dp=world, zero=3, impl="torch", precision="fp32", batch_size=sequences * world,
                        seq_len=tokens)


@figure("fsdp_peak_memory_vs_estimate", target="<= 1.1", quick=dict(shapes=((8, 64), (1, 16)), steps=2),
        full=dict(shapes=((8, 64), (1, 16)), steps=2))
def fsdp_peak_memory_vs_estimate(shapes, steps: int) -> Reading:
    """The most memory a training step of FullyShardedDataParallel (Adam, fp32, 2 ranks) holds per rank, measured,
    over ``gpucourse memory``'s estimate for ZeRO-3 of the same model and batch; the largest ratio over ranks and
    batch shapes (a long batch, where activations weigh most, and a short one, where weights, gradients and Adam's
    moments do)."""
    from ..modeled.memory import estimate
    from ..runtime import launch

    per_rank = launch(fsdp_module_peaks, shapes, steps, world_size=RANKS, timeout=RUN_TIMEOUT_S, quiet=True)
    ratios, detail = {}, {}
    for i, (sequences, tokens) in enumerate(shapes):
        want = estimate(fsdp_estimate_config(sequences, tokens))["per_rank"]
        for rank, peaks in enumerate(per_rank):
            key = f"rank {rank}, {sequences} sequences of {tokens} tokens"
            ratios[key] = peaks[i]["total"] / sum(want[rank].values())
            detail[key] = {"measured": peaks[i], "estimate": want[rank]}
    worst = max(ratios, key=ratios.get)
    return Reading(ratios[worst], {"ratios": ratios, "peaks": detail},
                   f"{human_bytes(detail[worst]['measured']['total'], binary=True)} at most, estimated "
                   f"{human_bytes(sum(detail[worst]['estimate'].values()), binary=True)} ({worst})")


@figure("checkpointing_activation_ratio", quick=dict(), full=dict())
def checkpointing_activation_ratio() -> Reading:
    """Saved activation bytes with activation checkpointing over without (tiny model)."""
    sizes = {}
    for ckpt in (False, True):
        result = run(bench_config(impl="scratch", dp=1, steps=1, checkpoint_activations=ckpt),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        sizes[ckpt] = result.memory["0"]["activations"]
    value = ratio(sizes[True], sizes[False])
    return Reading(value, {"plain_bytes": sizes[False], "checkpointed_bytes": sizes[True]},
                   f"{human_bytes(sizes[True])} with checkpointing, {human_bytes(sizes[False])} without")


@figure("selective_activation_ratio", quick=dict(), full=dict())
def selective_activation_ratio() -> Reading:
    """Saved activation bytes with selective recomputation over none, attention written out (tiny model, bf16
    weights, as Korthikanti et al. count), beside their formula's ratio for one layer at this shape (with dropout,
    which the run has not: its scores are 2 of the formula's 5 bytes)."""
    from ..modeled.memory import korthikanti_layer_bytes

    sizes = {}
    for recompute in ("none", "selective"):
        result = run(bench_config(impl="scratch", dp=1, steps=1, precision="bf16", master_weights=True,
                                   attention="math", checkpoint_activations=recompute),
                     timeout=RUN_TIMEOUT_S, quiet=True)
        sizes[recompute] = result.memory["0"]["activations"]
    cfg = bench_config(dp=1)
    mc = cfg.model_config()
    paper = [korthikanti_layer_bytes(cfg.seq_len, cfg.batch_size, mc.n_embd, mc.n_head, recompute=r)
             for r in ("selective", "none")]
    value = ratio(sizes["selective"], sizes["none"])
    return Reading(value, {"none_bytes": sizes["none"], "selective_bytes": sizes["selective"],
                           "korthikanti_ratio": paper[0] / paper[1]},
                   f"{human_bytes(sizes['selective'])} selective, {human_bytes(sizes['none'])} none "
                   f"({value:.3f}; Korthikanti et al.'s layer: {paper[0] / paper[1]:.3f})")


@figure("published_layouts_fit", target="== 1.0", quick=dict(), full=dict())
def published_layouts_fit() -> Reading:
    """The share of the published training runs (:mod:`gpucourse.modeled.published`) whose memory estimate, as their
    framework keeps it, fits their GPU: each of them ran, so each should."""
    from ..modeled.published import memory_fits

    rows = memory_fits()
    misfits = {r["name"]: r["max_total"] for r in rows if not r["fits"]}
    share = 1 - len(misfits) / len(rows)
    return Reading(share, {"runs": len(rows), "misfits": misfits},
                   f"{len(rows) - len(misfits)} of {len(rows)} fit"
                   + "".join(f"; {name} needs {human_bytes(b, binary=True)}" for name, b in misfits.items()))
