"""The commands that work on paper, starting no rank: ``schedule``, ``memory``, ``plan``, ``batch-size``, ``replay``."""

from __future__ import annotations

import json
import sys
import textwrap

from ..files import write_atomic
from ..modeled.gpus import GPU
from ..parallel import check
from ..parallel.schedule_table import SCHEDULES
from ..modeled.plan import EFFICIENCY, FRAMEWORK, PARAMS, PRECISIONS as PLAN_PRECISIONS
from ..runtime.launcher import WorkerError
from ..interop.serve_config import TOOLS as SERVE_TOOLS
from ..config import AUTO_PRECISION, TrainConfig, allowed
from ..modeled.serve_plan import BATCHING, CONTEXT as SERVE_CONTEXT, FORMAT, WEIGHT_FORMAT, WEIGHTS
from ..modeled.shapes import PART_KINDS, SHAPE
from ..values import GPUS_PER_NODE, POSITIVE, POSITIVE_NUMBER, RANKS, SEQUENCES, TOKENS, Name, number
from .common import SAVED_RUN, UsageError, add_layout_args, check_writable, config_from, write_json

TRAIN = TrainConfig()  # the training defaults, which memory --serve does not take
LAID_OUT = 1 << 13  # forwards `schedule` lays out: 64 stages of 128 microbatches take seconds, a million minutes
SERVE_WEIGHTS = "bf16"  # how a served model's weights are stored unless told
MEMORY_PRECISION = Name(dict.fromkeys([*allowed("precision").names(), *WEIGHTS]))  # training's or serving's
PLAN_PRECISION = Name(dict.fromkeys([*PLAN_PRECISIONS, *WEIGHTS]))  # a planned run's or a served model's weights'


def cmd_schedule(args) -> int:
    from ..modeled import plan
    from ..parallel import schedules, schedules_virtual

    record = SCHEDULES[args.schedule]
    if args.virtual_stages != 2 and record.chunks != 0:
        chooses = [s.name for s in SCHEDULES.values() if s.chunks == 0]
        two = [s.name for s in SCHEDULES.values() if s.chunks == 2]
        raise UsageError(f"--virtual-stages sets the chunks per rank of {' and '.join(chooses)} ({' and '.join(two)} "
                         f"have 2, the others 1).")
    problem = record.problem(args.pp, args.microbatches, args.virtual_stages)
    if problem:
        raise UsageError(problem)
    per_rank = record.chunks_per_rank(args.virtual_stages)
    if args.pp * args.microbatches * per_rank > LAID_OUT:
        raise UsageError(f"--pp {args.pp} × --microbatches {args.microbatches} × {per_rank} chunk(s) a rank = "
                         f"{args.pp * args.microbatches * per_rank} forwards on the clock, more than it lays out "
                         f"quickly (at most {LAID_OUT}); use fewer.")
    if args.json:
        check_writable(args.json, "--json")
    pp, m = args.pp, args.microbatches
    ops, layout, sim, cost = plan.lay_out_schedule(args.schedule, pp, m, args.virtual_stages, args.cost_f,
                                                   args.cost_b, args.cost_comm)
    if layout is None:
        formula = schedules.formula_bubble(args.schedule, pp, m)
        costs = f"F costs {args.cost_f:g}, B {args.cost_b:g}"
        shape = SCHEDULES[args.schedule].formula  # the closed form of its bubble fraction
        rule = f"equal-cost formula {shape} = {formula:.1%}"
        ratio_rule = f"; (p-1)/m = {(pp - 1) / m:.1%}" if "m" in shape else ""
    else:
        formula = None
        costs = (f"{layout.v} chunk{'s' * (layout.v > 1)} per rank ({layout.shape} placement), a rank's F costs "
                 f"{args.cost_f:g}, B {cost['b']:g}" + (f", W {cost['w']:g}" if "w" in cost else ""))
        rule = "transfers asynchronous"
        interleaved = schedules_virtual.formula_bubble_ratio(args.schedule, pp, m, layout.v)
        ratio_rule = f"; (p-1)/(v·m) = {interleaved:.1%}" if interleaved is not None else ""
    print(f"{args.schedule}: {pp} stage{'s' * (pp > 1)}, {m} microbatch{'es' * (m > 1)}; "
          f"{costs}, a transfer {args.cost_comm:g}")
    print(schedules.gantt(sim))
    print(f"  makespan        {sim.makespan:g} time units")
    print(f"  bubble          {sim.bubble_fraction:.1%} of stage-time not computing ({rule})")
    print(f"                  {sim.bubble_ratio:.1%} of the compute time (Megatron-LM's definition{ratio_rule})")
    print(f"  peak in flight  {' '.join(map(str, sim.peak_in_flight))} microbatches held, stage 0 to {pp - 1}")
    if args.json:
        write_atomic(args.json, json.dumps({
            "schedule": args.schedule, "pp": pp, "microbatches": m,
            "cost": {"f": args.cost_f, "b": args.cost_b, "comm": args.cost_comm},
            "ops": [[str(op) for op in row] for row in ops],
            "timeline": [[{"op": str(op), "start": b, "end": e} for op, b, e in row] for row in sim.timeline],
            "makespan": sim.makespan, "bubble_fraction": sim.bubble_fraction, "formula_bubble": formula,
            "bubble_ratio": sim.bubble_ratio,
            "peak_in_flight": sim.peak_in_flight, "busy": sim.busy, "comm": sim.comm, "idle": sim.idle,
        }, indent=1))
        print(f"  written to {args.json}")
    return 0


def cmd_memory(args) -> int:
    from ..modeled import memory

    if args.json:
        check_writable(args.json, "--json")
    if args.serve:
        return _serve_memory(args)
    args.precision = allowed("precision").check(args.precision or TRAIN.precision, "--precision")
    args.seq_len = args.seq_len or TRAIN.seq_len
    if args.precision == AUTO_PRECISION:  # on paper too, the half precision a run here would choose
        from .. import platforms

        args.precision = platforms.resolve(config_from(args)).precision
    if args.params is not None:
        est = memory.estimate_params(int(args.params), args.dp, args.zero, args.precision, args.master_weights)
        print(f"{args.params:,.0f} parameters, dp={args.dp}, zero={args.zero}, {args.precision}"
              f"{' with fp32 master weights' if args.master_weights else ''}: per rank")
        for k, v in est.items():
            print(f"  {k:<10} {v / 2**30:10.3f} GiB")
        print(f"  {'total':<10} {sum(est.values()) / 2**30:10.3f} GiB (activations need the model's shape: "
              f"use --model)")
    else:
        est = memory.estimate(config_from(args))
        print(memory.format_estimate(est))
    write_json(args.json, est)
    return 0


def _serve_memory(args) -> int:
    """``memory --serve``: what serving the model (or ``--shape``) holds on each GPU."""
    import dataclasses

    from ..modeled import serve_plan
    from ..modeled.shapes import Shape

    weights = WEIGHT_FORMAT.check(args.precision or SERVE_WEIGHTS, "--precision")
    if args.shape:
        shape, context = args.shape, args.seq_len or SERVE_CONTEXT
    else:
        cfg = config_from(args)
        context = args.seq_len or min(SERVE_CONTEXT, cfg.model_config().block_size)
        # The model's own rules, as training checks them (a mixture of one expert is none), and its context.
        cfg = check(dataclasses.replace(cfg, precision=TRAIN.precision, seq_len=context), runnable=False)
        shape = dataclasses.replace(Shape.of_model(cfg.model_config()), name=args.model)
    budget = None if args.budget_gb is None else args.budget_gb * 2**30
    est = serve_plan.memory(shape, context, args.tp, args.pp, weights, args.kv, budget=budget)
    print(serve_plan.format_memory(est))
    write_json(args.json, est)
    return 0


def cmd_plan(args) -> int:
    from ..modeled import plan

    if args.json:
        check_writable(args.json, "--json")
    parts = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "mlp", "vocab", "experts",
                                           "top_k", "expert_ffn") if getattr(args, k) is not None}
    if args.params is None and args.shape is None and not parts:
        raise UsageError("plan needs --params (a parameter count), --shape (one of "
                         f"{', '.join(plan.SHAPES)}) or the shape's parts (--layers, --hidden, --heads, ...).")
    shape = args.shape  # a name of the table (the flag checked it), the parts given on top of it, or neither
    try:
        if parts:
            base = plan.get_shape(args.shape).as_dict() if args.shape else {}
            shape = {**{k: v for k, v in base.items() if k != "source"}, **parts}
        if shape is not None:
            shape = plan.get_shape(shape)  # resolved once, here, and handed down as a Shape
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.serve:
        return _serve_plan(args, shape)
    if args.precision not in PLAN_PRECISIONS:
        raise UsageError(f"--precision {args.precision} stores a served model's weights (plan --serve); a planned "
                         f"training run computes in {', '.join(PLAN_PRECISIONS)}.")
    result = plan.plan(args.params, args.gpus, args.gpu, args.gpus_per_node, args.batch_size, args.seq_len,
                       args.precision, args.efficiency, shape=shape, framework=args.framework,
                       offload=args.offload)
    print(plan.format_plan(result, top=args.top, explained=args.explain))
    write_json(args.json, result)
    return 0


def _serve_plan(args, shape) -> int:
    """``plan --serve``: the serving layouts of a shape (a parameter count alone does not say its KV heads)."""
    from ..interop import serve_config
    from ..modeled import serve_plan

    if shape is None:
        raise UsageError("plan --serve needs --shape or the shape's parts: a KV cache's size depends on its heads.")
    result = serve_plan.plan(shape, args.gpus, args.gpu, args.context, args.tpot_ms / 1e3, args.precision, args.kv,
                             args.gpus_per_node, args.prompt, args.output, args.batching,
                             token_budget=args.token_budget)
    if args.print_config is not None:  # the fastest layout in the server's own names; the table stays unprinted
        best = result["layouts"][0]
        if not best["batch"]:
            raise UsageError(f"no layout of {args.gpus} × {args.gpu} serves a sequence of {args.context} tokens "
                             f"within {args.tpot_ms:g} ms a token: nothing to print.")
        layout = serve_config.layout_from_plan(result, best, **({"model": args.model_path} if args.model_path else {}))
        text, notes = serve_config.render(args.print_config, layout)
        print(text, end="" if text.endswith("\n") else "\n")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        return 0
    print(serve_plan.format_plan(result, top=args.top))
    write_json(args.json, result)
    return 0


def cmd_batch_size(args) -> int:
    from .. import platforms
    from ..modeled import memory
    from ..runtime import devices
    from ..runtime.launcher import visible_gpus

    if args.budget_gb is None:  # what a run can use on the smallest GPU here
        known = platforms.run_budget(devices.visible())
        if known is None:
            raise UsageError("no GPU with a known memory is visible here: give the memory per rank, --budget-gb N.")
        args.budget_gb = round(known[0] / 2**30, 2)
        print(f"budget: {args.budget_gb:g} GiB, what a run can use on each {known[1]} (--budget-gb to choose)")
    cfg = check(platforms.resolve(config_from(args)), runnable=False)
    budget = args.budget_gb * 2**30
    # Measured where the GPUs are real; described ones (GPUCOURSE_FAKE_GPUS) have CPU processes stand in for them.
    measured = visible_gpus() >= cfg.world_size and cfg.device != "cpu" and not devices.visible().described
    fits = None
    if measured:
        from ..train import run

        def fits(trial):
            import dataclasses as dc
            try:
                result = run(dc.replace(trial, steps=1, device="cuda"), quiet=True)
            except WorkerError as e:
                if "OutOfMemory" in e.exc_type:
                    return False
                raise
            return max(m.get("device_peak", 0) for m in result.memory.values()) <= budget
    found = memory.largest_microbatch(cfg, budget, fits=fits)
    how = "measured on CUDA" if measured else "estimated"
    if not found["microbatch"]:  # an answer, but no result: said as a failure is, on stderr
        print(f"gpucourse: not even one sequence per microbatch fits in {args.budget_gb:g} GiB ({how}).",
              file=sys.stderr)
        return 1
    m = found["microbatch"]
    accum = cfg.microbatches if cfg.pp > 1 else cfg.grad_accum
    print(f"largest microbatch: {m} sequences of {cfg.seq_len} tokens per forward on each rank ({how}, "
          f"budget {args.budget_gb:g} GiB)")
    print(f"  global batch = microbatch × {'microbatches' if cfg.pp > 1 else 'grad_accum'} × dp = "
          f"{m} × {accum} × {cfg.dp} = {found['batch_size']} sequences per optimizer step")
    if measured:
        print("  measured: the CUDA allocator's peak in a one-step trial of each microbatch tried")
    print("  a bigger global batch at the same memory: raise grad_accum (more microbatches per step, same peak);\n"
          "  a bigger microbatch raises the peak (activations grow with it).")
    tried = ", ".join(f"{b}{'✓' if ok else '✗'}" for b, ok in sorted(found["tried"].items()))
    print("\n".join(textwrap.wrap(f"tried: {tried}", width=100, initial_indent="  ", subsequent_indent=" " * 9)))
    return 0


def cmd_replay(args) -> int:
    import statistics

    from .. import profiling
    from ..modeled.gpus import get_gpu
    from ..modeled.replay import ReplayError, replay

    measured = args.run  # read as the flag was parsed
    if args.json:
        check_writable(args.json, "--json")
    try:
        modeled = replay(measured, on=args.on, gpus_per_node=args.gpus_per_node, nodes=args.nodes)
    except ReplayError as e:
        raise UsageError(str(e)) from None
    info = modeled.extras["modeled"]
    for note in info["notes"]:
        print(f"gpucourse: note: {note}", file=sys.stderr)
    steps = lambda r: statistics.median(r.step_times_s[1:] or r.step_times_s)  # noqa: E731
    cfg = TrainConfig.from_dict(measured.config)  # a saved config may leave its defaults out
    print(f"{measured.world_size} rank(s) of {cfg.model}, replayed on {info['cluster']} (modeled)")
    print(f"step time       measured {1e3 * steps(measured):.3f} ms on {measured.device}, "
          f"modeled {1e3 * steps(modeled):.3f} ms")
    print(profiling.format_summary(profiling.summarize(modeled, peak_flops=get_gpu(args.on).peak_flops(
        cfg.precision)), peak_name=f"{args.on} {cfg.precision}"))
    if args.json:
        modeled.save(args.json)
        print(f"  the modeled run written to {args.json}")
    return 0


def add_commands(sub) -> None:
    """This group's subcommands, on the ``gpucourse`` parser's ``sub``."""
    p = sub.add_parser("schedule", help="lay out a pipeline schedule on a clock, without starting any rank",
                       description="Print a pipeline schedule's per-stage timeline, bubble and activations held.")
    p.add_argument("--pp", type=POSITIVE, default=4, help="pipeline stages")
    p.add_argument("--microbatches", type=POSITIVE, default=8, help="microbatches per step")
    p.add_argument("--schedule", type=Name(SCHEDULES), default="1f1b",
                   help="; ".join(f"{name}: {s.summary}" for name, s in SCHEDULES.items()))
    p.add_argument("--virtual-stages", type=POSITIVE, default=2, help="interleaved-1f1b: model chunks per rank")
    # The costs are in units of the clock's own: a million of them is a transfer no schedule is drawn for.
    p.add_argument("--cost-f", type=number(above=0, most=1e6), default=1.0,
                   help="time of one stage's forward of one microbatch")
    p.add_argument("--cost-b", type=number(above=0, most=1e6), default=2.0,
                   help="time of one stage's backward of one microbatch")
    p.add_argument("--cost-comm", type=number(least=0, most=1e6), default=0.0,
                   help="time of one activation or gradient transfer")
    p.add_argument("--json", metavar="FILE", help="write the schedule, timeline and figures as JSON")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("memory", help="estimate memory per rank for a layout, before it runs",
                       description="Takes the same flags as train; --params N sizes a model of N parameters.")
    # Serving stores its weights in bf16 and holds sequences thousands of tokens long: --serve has defaults of its own.
    add_layout_args(p, changed={
        "precision": {"type": MEMORY_PRECISION, "default": None,
                      "help": f"training: {', '.join(allowed('precision').names())} (default {TRAIN.precision}); "
                              f"with --serve, the weights' format: {', '.join(WEIGHTS)} (default {SERVE_WEIGHTS})"},
        "seq_len": {"default": None,
                    "help": f"training: tokens per sequence (default {TRAIN.seq_len}); with --serve, the tokens "
                            f"each sequence holds, prompt and answer (default {SERVE_CONTEXT}, or the model's "
                            f"context where it is shorter)"}})
    p.add_argument("--params", type=POSITIVE_NUMBER, default=None,
                   help="a parameter count instead of --model (e.g. 70e9)")
    p.add_argument("--serve", action="store_true",
                   help="serving instead of training: weights per GPU, KV cache bytes per token and the largest batch "
                        "of --seq-len-token sequences that fits --budget-gb (under --tp, --pp, --precision)")
    p.add_argument("--shape", type=SHAPE, help="with --serve: a named public shape (gpucourse.modeled.shapes) instead of "
                                                "--model")
    p.add_argument("--kv", type=FORMAT, default="bf16", help="with --serve: the KV cache's number format: bf16, fp8 or fp32")
    p.add_argument("--budget-gb", type=POSITIVE_NUMBER, default=None,
                   help="with --serve: memory per GPU, GiB (default: what an H100 leaves a run)")
    p.add_argument("--json", metavar="FILE", help="write the estimate as JSON")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("plan", help="rank the layouts of a large model on many GPUs, on paper")
    p.add_argument("--params", type=PARAMS, help="parameters, e.g. 70e9 (a plausible dense GPT shape is assumed)")
    p.add_argument("--shape", type=SHAPE, help="a named public shape instead (gpucourse.modeled.shapes.SHAPES: gpt3-175b, megatron-1t, "
                                   "llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, deepseek-v3-like, ...); "
                                   "the flags below change its parts")
    for flag, text in (("--layers", "transformer blocks"), ("--hidden", "model width"), ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads (GQA)"), ("--ffn", "MLP width (default 4 × hidden)"),
                       ("--mlp", "gelu or swiglu"), ("--vocab", "vocabulary"),
                       ("--experts", "routed experts per MoE block"), ("--top-k", "experts per token"),
                       ("--expert-ffn", "an expert's MLP width")):
        p.add_argument(flag, type=PART_KINDS[flag[2:].replace("-", "_")], default=None, help=f"shape: {text}")
    p.add_argument("--framework", type=FRAMEWORK, default=None,
                   help="whose overlap of communication with compute to assume: megatron-core (default), "
                        "megatron-core-tp-overlap, megatron-2021, fsdp, ddp")
    p.add_argument("--gpus", type=RANKS, required=True, help="number of GPUs")
    p.add_argument("--gpu", type=GPU, default="h100", help="GPU kind from the table (gpucourse.modeled.gpus), e.g. h100, a100")
    p.add_argument("--gpus-per-node", type=GPUS_PER_NODE, default=8,
                   help="GPUs per server (tensor parallelism stays inside)")
    p.add_argument("--batch-size", type=SEQUENCES, default=1024, help="global batch in sequences")
    p.add_argument("--seq-len", type=TOKENS, default=4096, help="tokens per sequence")
    p.add_argument("--precision", type=PLAN_PRECISION, default="bf16",
                   help="bf16 (with fp32 master weights), fp8 (fp8 matmuls, the rest as bf16) or fp32; with --serve, "
                        "how the weights are stored: fp32, bf16, fp8 (W8A8 where the GPU multiplies FP8, weight-only "
                        "elsewhere), int8 or int4 (weight-only: W8A16, W4A16)")
    p.add_argument("--efficiency", type=EFFICIENCY, default=None,
                   help="time compute as this fraction of peak FLOP/s, spread evenly (default: kernel by kernel "
                        "on the model's shape)")
    p.add_argument("--serve", action="store_true",
                   help="plan serving instead of training: tp × pp layouts (replicas over the rest) ranked by modeled "
                        "output tokens per second under --tpot-ms, each at the largest batch that fits and meets it")
    p.add_argument("--context", type=TOKENS, default=SERVE_CONTEXT,
                   help=f"with --serve: the most tokens a sequence may hold, prompt + answer (the server's "
                        f"max_model_len; default {SERVE_CONTEXT})")
    p.add_argument("--prompt", type=TOKENS, default=None,
                   help="with --serve: a request's prompt tokens (default: what --output leaves of the context, or "
                        "half)")
    p.add_argument("--output", type=TOKENS, default=None,
                   help="with --serve: a request's answer tokens (default: what --prompt leaves of the context, or "
                        "half)")
    p.add_argument("--token-budget", type=TOKENS, default=None,
                   help="with --serve: tokens a step feeds, decodes first, prompts in chunks of the rest (chunked "
                        "prefill: vLLM's max_num_batched_tokens); default whole prompts")
    p.add_argument("--batching", type=BATCHING, default="continuous",
                   help="with --serve: continuous (a seat refilled as soon as it is free, paged KV cache) or static "
                        "(whole batches); each batch sized and timed at what its sequences hold")
    p.add_argument("--tpot-ms", type=POSITIVE_NUMBER, default=50.0,
                   help="with --serve: the time-per-output-token target")
    p.add_argument("--kv", type=FORMAT, default="bf16", help="with --serve: the KV cache's number format: bf16, fp8 or fp32")
    p.add_argument("--print-config", type=Name(SERVE_TOOLS), metavar="TOOL", default=None,
                   help="with --serve: the fastest layout as vllm's engine arguments or trtllm's LLM API (what the "
                        "tool cannot express on stderr)")
    p.add_argument("--model-path", default=None,
                   help="with --print-config: the model name or path the server loads (default: a placeholder)")
    p.add_argument("--offload", action="store_true",
                   help="also try each layout with the optimizer on the CPU (ZeRO-Offload): GPU memory freed, PCIe "
                        "transfers and a CPU Adam step added")
    p.add_argument("--top", type=POSITIVE, default=10, help="rows to print")
    p.add_argument("--explain", action="store_true",
                   help="each row's step as its parts (compute, recompute, bubble, each kind of communication, "
                        "optimizer) and its memory per GPU, then the layouts searched")
    p.add_argument("--json", metavar="FILE", help="write every layout as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("batch-size", help="the largest microbatch that fits a memory budget",
                       description="Bisection: measured on CUDA, estimated on CPU against the budget.")
    add_layout_args(p)
    p.add_argument("--budget-gb", type=POSITIVE_NUMBER, default=None,
                   help="memory per rank, GiB (default: what a run can use on the smallest GPU here)")
    p.set_defaults(func=cmd_batch_size)

    p = sub.add_parser("replay", help="replay a saved run on a modeled GPU cluster: its step time, shares and MFU there",
                       description="Lay a run's recorded work (train --json FILE) out on modeled GPUs: each "
                                   "forward and backward timed from its FLOPs, each collective by an alpha-beta "
                                   "model over the link it crosses (docs/modeled-timing.md).")
    p.add_argument("run", metavar="RUN.json", type=SAVED_RUN, help="a run saved with 'gpucourse train --json FILE'")
    p.add_argument("--on", type=GPU, default="h100",
                   help="GPU kind from the table (gpucourse.modeled.gpus): a100, h100, h200, b200, l4")
    p.add_argument("--gpus-per-node", type=GPUS_PER_NODE, default=8, help="GPUs per server (default 8)")
    p.add_argument("--nodes", type=RANKS, default=None, help="servers (default: as many as the run's ranks need)")
    p.add_argument("--json", metavar="FILE", help="also write the modeled run as JSON")
    p.set_defaults(func=cmd_replay)
