"""The ``gpucourse`` command: the same runtime as the notebooks, from a terminal.

Every subcommand checks its input before any rank starts; bad input gets one
sentence on stderr and exit status 2, and no file is half-written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap

from .config import ConfigError, TrainConfig, supported_table
from .files import write_atomic
from .parallel.context_parallel import ATTENTIONS
from .parallel.schedule_table import SCHEDULES
from .readable import human_bytes
from .runtime.launcher import (LaunchError, LaunchTimeout, WorkerError, check_in_place_world, in_place,
                               plan_device)


class UsageError(Exception):
    """Bad command-line input; the message is one sentence."""


def _check_writable(path: str, flag: str) -> None:
    """Refuse an output path we could not write, before anything runs."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path} cannot be written: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path} cannot be written: permission denied.")


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model size: tiny, small, medium, gpt2-small, gpt2-medium")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree (stages)")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel degree: seq_len / cp tokens per rank")
    p.add_argument("--cp-algo", default=d.cp_algo, help="context-parallel attention: " + "; ".join(
        f"{name} ({a.summary})" for name, a in ATTENTIONS.items()))
    p.add_argument("--zigzag", action="store_true",
                   help="context parallel: 2·cp chunks, rank i holding i and 2·cp-1-i (causal load balance)")
    p.add_argument("--moe-experts", type=int, default=d.moe_experts,
                   help="mixture of experts: E expert MLPs in place of each MoE block's MLP (0: dense)")
    p.add_argument("--moe-top-k", type=int, default=d.moe_top_k, help="mixture of experts: experts per token (2)")
    p.add_argument("--moe-every", type=int, default=d.moe_every,
                   help="mixture of experts in every block (1) or every n-th block (n)")
    p.add_argument("--moe-capacity", type=float, default=d.moe_capacity,
                   help="capacity factor: an expert takes at most c·tokens·top_k/E choices (default: no dropping)")
    p.add_argument("--moe-aux", type=float, default=d.moe_aux, help="weight of the load-balancing loss (0.01)")
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel degree: experts spread over ep dp ranks")
    p.add_argument("--zero", type=int, default=d.zero, help="ZeRO stage 0-3")
    p.add_argument("--schedule", default=None,
                   help=f"pipeline schedule (with --pp > 1; default {d.schedule}): {', '.join(SCHEDULES)}")
    p.add_argument("--virtual-stages", type=int, default=d.virtual_stages,
                   help="interleaved-1f1b: model chunks per pipeline rank")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="pipeline microbatches per step")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="gradient-accumulation microbatches")
    p.add_argument("--precision", default=d.precision, help="fp32, bf16 or fp16 (autocast unless --master-weights)")
    p.add_argument("--master-weights", action="store_true",
                   help="half-precision weights and gradients, fp32 master copy in the optimizer")
    p.add_argument("--checkpoint-activations", nargs="?", const="full", default="none",
                   choices=("none", "selective", "full"),
                   help="recompute activations in backward instead of keeping them: full (alone: every block's) or "
                        "selective (attention's scores, softmax and weighted sum only)")
    p.add_argument("--attention", default=d.attention, choices=("flash", "math"),
                   help="flash (fused: no T × T scores kept) or math (the scores written out and kept, as before "
                        "FlashAttention)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: keep seq_len / tp tokens per rank between sub-layers (LayerNorm, residual)")
    p.add_argument("--impl", default=d.impl,
                   help="scratch (gpucourse's own), torch (PyTorch's) or accelerate (Hugging Face Accelerate)")
    p.add_argument("--bucket-mb", type=float, default=d.bucket_mb,
                   help="data parallel: gradient bucket size in MB, all-reduced during backward")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch per optimizer step, in sequences (= microbatch × grad_accum × dp)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data order")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--straggler", metavar="RANK:MS", default=d.straggler,
                   help="plant a straggler: that rank loses MS milliseconds every step, as a slow device would")


def _config_from(args) -> TrainConfig:
    """The TrainConfig the flags describe (flags a subcommand lacks keep their defaults)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if "schedule" in given:
        if given["schedule"] is None:
            del given["schedule"]
        elif given.get("pp", 1) == 1:  # a schedule orders a pipeline: without one it would change nothing
            raise UsageError(f"--schedule {given['schedule']} orders a pipeline's stages; give --pp 2 or more with it.")
    if "no_record" in vars(args):
        given["record"] = not args.no_record
    return TrainConfig(**given)


class _ProgressBar:
    """A one-line bar on a terminal; a line per tenth of the run otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, s: dict) -> None:
        done, total = s["step"] + 1, s["steps"]
        text = f"step {done:>{len(str(total))}}/{total}  loss {s['loss']:.4f}  {s['time_s'] * 1e3:7.1f} ms/step"
        if self.tty:
            width = 24
            filled = round(width * done / total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if done == total:
                self.stream.write("\n")
        elif done == total or done % max(1, total // 10) == 0:
            self.stream.write(text + "\n")
        self.stream.flush()


def summary_table(result) -> str:
    """The end-of-run summary the CLI prints."""
    cfg = result.config
    steps = len(result.losses)
    per_step = sum(result.comm_bytes.get("per_step", [])) / max(steps, 1)
    rows = [
        ("layout", TrainConfig.from_dict(cfg).layout()),
        ("impl", cfg["impl"]),
        ("ranks", f"{result.world_size} on {result.device} ({result.backend})"),
        ("model", cfg["model"]),
        ("global batch", f"{cfg['batch_size']} seq × {cfg['seq_len']} tokens "
                         f"(microbatch {cfg['batch_size'] // (cfg['dp'] * cfg['grad_accum'])} × "
                         f"grad_accum {cfg['grad_accum']} × dp {cfg['dp']})"),
        ("steps", str(steps) + (f" (steps {result.start_step}–{result.start_step + steps - 1}, resumed)"
                                if result.start_step else "")),
        ("loss", f"{result.losses[0]:.4f} → {result.losses[-1]:.4f}"),
        ("step time", f"{1e3 * sum(result.step_times_s) / steps:.1f} ms mean"),
        ("throughput", f"{result.tokens_per_s:,.0f} tokens/s"),
        ("communication", f"{human_bytes(per_step)} per step, all ranks (run total: "
                          + ", ".join(f"{op} {human_bytes(b)}" for op, b in result.comm_bytes.get("per_op", {}).items()
                                      if op != "recv")  # a message is counted once, by its sender
                          + (("; point-to-point counted once, as sent" if "send" in result.comm_bytes.get("per_op", {})
                              else "") + ")") if per_step else "none"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def cmd_train(args) -> int:
    if args.list:
        rows = supported_table()
        w = max(len(r["layout"]) for r in rows)
        ww = max(len(r["what"]) for r in rows)
        print(f"{'layout':<{w}}  {'impl':<10}  {'what':<{ww}}  example")
        for r in rows:
            print(f"{r['layout']:<{w}}  {r['impl']:<10}  {r['what']:<{ww}}  {r['example']}")
        return 0
    cfg = _config_from(args)
    if args.print_config is not None:  # the same layout in another tool's names; nothing trains
        return _print_stack_config(cfg, args.print_config)
    cfg.validate()
    for path, flag in ((args.json, "--json"), (args.export_weights, "--export-weights")):
        if path:
            _check_writable(path, flag)
    if in_place():
        check_in_place_world(cfg.world_size, "pp × dp × cp × tp")
    else:
        cfg.validate_on(plan_device(cfg.device, cfg.world_size).device)
    analysis = _profile_options(args, cfg)
    if cfg.memory_snapshot:
        _check_folder(cfg.memory_snapshot, "--memory-snapshot", "the snapshots")

    from .train import run

    rank0 = not in_place() or int(os.environ["RANK"]) == 0
    result = run(cfg, timeout=args.timeout, export_weights=args.export_weights,
                 on_step=None if args.quiet else _ProgressBar(), quiet=args.quiet)
    if rank0:
        if args.json:
            result.save(args.json)
        print(summary_table(result))
        for path, what in ((args.json, "result"), (args.export_weights, "weights")):
            if path:
                print(f"  {what} written to {path}")
        if analysis is not None:
            _print_profile(result, cfg, *analysis)
        if cfg.memory_snapshot:
            from .profiling import snapshot_path

            paths = ", ".join(snapshot_path(cfg.memory_snapshot, r) for r in range(result.world_size))
            print(f"  memory snapshots: {paths} (open in https://pytorch.org/memory_viz)")
    return 0


def _print_stack_config(cfg: TrainConfig, tool: str) -> int:
    """Print ``cfg`` as ``tool``'s settings on stdout; what the tool cannot express, one note a line, on stderr."""
    from . import stack_config

    if tool not in stack_config.TOOLS:
        raise UsageError(f"--print-config {tool!r} is not one of {', '.join(stack_config.TOOLS)}.")
    out = stack_config.translate(cfg, tool)
    print(out.text, end="")
    for note in out.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _check_folder(path: str, flag: str, what: str) -> None:
    """Refuse, in one sentence, a folder flag that names a file or whose parent does not exist."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a file; give a folder for {what}.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(path) and not os.path.isdir(parent):
        raise UsageError(f"{flag} {path} cannot be created: the folder {parent} does not exist.")


def _profile_options(args, cfg: TrainConfig):
    """(peak FLOP/s, where it came from, baseline RunResult) for the analysis, or None; bad values refused first."""
    if not (args.profile or args.peak_tflops or args.gpu or args.baseline):
        return None
    if args.profile:
        _check_folder(args.profile, "--profile", "the traces")
    if args.peak_tflops is not None and args.gpu:
        raise UsageError("give --peak-tflops or --gpu, not both.")
    peak = name = None
    if args.peak_tflops is not None:
        if not args.peak_tflops > 0:
            raise UsageError(f"--peak-tflops {args.peak_tflops:g} must be positive.")
        peak, name = args.peak_tflops * 1e12, "--peak-tflops"
    elif args.gpu:
        from .gpus import get_gpu

        try:
            spec = get_gpu(args.gpu)
        except (KeyError, ValueError) as e:
            raise UsageError(str(e).strip("'\"")) from None
        peak, name = spec.peak_flops(cfg.precision), f"{spec.name} {'fp32' if cfg.precision == 'fp32' else 'bf16'} peak"
    baseline = None
    if args.baseline:
        from .measure import RunResult

        try:
            baseline = RunResult.load(args.baseline)
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--baseline {args.baseline} is not a RunResult JSON file (from train --json): {e}.") from None
    return peak, name, baseline


def _print_profile(result, cfg: TrainConfig, peak, name, baseline) -> None:
    from . import profiling

    print()
    print(profiling.format_summary(profiling.summarize(result, peak_flops=peak, baseline=baseline), name))
    if cfg.profile:
        print(f"traces: {', '.join(profiling.trace_path(cfg.profile, r) for r in range(result.world_size))} "
              f"(open in https://ui.perfetto.dev or chrome://tracing)")


def cmd_bandwidth(args) -> int:
    from . import bandwidth

    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops is not None else list(bandwidth.OPS)
    bad = [o for o in ops if o not in bandwidth.OPS]
    if bad or not ops:
        raise UsageError(f"--ops {args.ops!r}: each must be one of {', '.join(bandwidth.OPS)}.")
    try:
        sizes = [bandwidth.parse_size(x) for x in args.sizes.split(",")] if args.sizes else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.world_size < 2:
        raise UsageError(f"--world-size {args.world_size} must be at least 2: a collective needs ranks to talk to.")
    if args.json:
        _check_writable(args.json, "--json")
    plan_device(args.device, args.world_size)  # refused before anything runs
    sizes = sizes or list(bandwidth.QUICK_SIZES if args.quick else bandwidth.SIZES)
    measured = bandwidth.measure(args.world_size, ops, sizes, quick=args.quick, device=args.device,
                                 copy_bytes=max(sizes), quiet=False)
    print(bandwidth.format_table(measured))
    _write_json(args.json, measured)
    return 0


def cmd_troubleshoot(args) -> int:
    from . import troubleshoot

    if args.list or not args.name:
        width = max(len(n) for n in troubleshoot.SCENARIOS)
        for name, scenario in troubleshoot.SCENARIOS.items():
            print(f"{name:<{width}}  {scenario.title}")
        if not args.list:
            print("\nrun one with: gpucourse troubleshoot NAME")
        return 0
    if args.name not in troubleshoot.SCENARIOS:
        raise UsageError(f"no scenario {args.name!r}; the scenarios are {', '.join(troubleshoot.SCENARIOS)}.")
    found = troubleshoot.run(args.name)
    return 1 if found["left_behind"] else 0


def cmd_schedule(args) -> int:
    from . import plan
    from .parallel import schedules, schedules_virtual

    if args.schedule not in SCHEDULES:
        raise UsageError(f"--schedule {args.schedule!r} is not one of {', '.join(SCHEDULES)}.")
    for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches),
                        ("--virtual-stages", args.virtual_stages)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be at least 1.")
    record = SCHEDULES[args.schedule]
    if args.virtual_stages != 2 and record.chunks != 0:
        chooses = [s.name for s in SCHEDULES.values() if s.chunks == 0]
        two = [s.name for s in SCHEDULES.values() if s.chunks == 2]
        raise UsageError(f"--virtual-stages sets the chunks per rank of {' and '.join(chooses)} ({' and '.join(two)} "
                         f"have 2, the others 1).")
    problem = record.problem(args.pp, args.microbatches, args.virtual_stages)
    if problem:
        raise UsageError(problem)
    if args.pp * args.microbatches > 1 << 20:
        raise UsageError(f"--pp {args.pp} × --microbatches {args.microbatches} is over a million "
                         f"microbatch-stages, too many to simulate quickly; use fewer.")
    for flag, value in (("--cost-f", args.cost_f), ("--cost-b", args.cost_b), ("--cost-comm", args.cost_comm)):
        if value < 0:
            raise UsageError(f"{flag} {value} must not be negative.")
    if args.json:
        _check_writable(args.json, "--json")
    pp, m = args.pp, args.microbatches
    ops, layout, sim, cost = plan.lay_out_schedule(args.schedule, pp, m, args.virtual_stages, args.cost_f,
                                                   args.cost_b, args.cost_comm)
    if layout is None:
        formula = schedules.formula_bubble(args.schedule, pp, m)
        costs = f"F costs {args.cost_f:g}, B {args.cost_b:g}"
        rule = f"equal-cost formula {'(p-1)/p' if args.schedule == 'naive' else '(p-1)/(m+p-1)'} = {formula:.1%}"
        ratio_rule = "" if args.schedule == "naive" else f"; (p-1)/m = {(pp - 1) / m:.1%}"
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


def _write_json(path: str | None, data) -> None:
    if path:
        write_atomic(path, json.dumps(data, indent=1, default=str))
        print(f"  written to {path}")


def cmd_memory(args) -> int:
    from . import memory

    if args.json:
        _check_writable(args.json, "--json")
    if args.params is not None:
        if args.params < 1:
            raise UsageError(f"--params {args.params:g} must be a positive number of parameters.")
        est = memory.estimate_params(int(args.params), args.dp, args.zero, args.precision, args.master_weights)
        print(f"{args.params:,.0f} parameters, dp={args.dp}, zero={args.zero}, {args.precision}"
              f"{' with fp32 master weights' if args.master_weights else ''}: per rank")
        for k, v in est.items():
            print(f"  {k:<10} {v / 2**30:10.3f} GiB")
        print(f"  {'total':<10} {sum(est.values()) / 2**30:10.3f} GiB (activations need the model's shape: "
              f"use --model)")
    else:
        est = memory.estimate(_config_from(args))
        print(memory.format_estimate(est))
    _write_json(args.json, est)
    return 0


def cmd_plan(args) -> int:
    from . import plan

    if args.json:
        _check_writable(args.json, "--json")
    parts = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "mlp", "vocab", "experts",
                                           "top_k", "expert_ffn") if getattr(args, k) is not None}
    if args.params is None and args.shape is None and not parts:
        raise UsageError("plan needs --params (a parameter count), --shape (one of "
                         f"{', '.join(plan.SHAPES)}) or the shape's parts (--layers, --hidden, --heads, ...).")
    shape = args.shape
    if parts:
        try:
            base = plan.get_shape(args.shape).as_dict() if args.shape else {}
        except ValueError as e:
            raise UsageError(str(e)) from None
        shape = {**{k: v for k, v in base.items() if k != "source"}, **parts}
    result = plan.plan(args.params, args.gpus, args.gpu, args.gpus_per_node, args.batch_size, args.seq_len,
                       args.precision, args.efficiency, shape=shape, framework=args.framework)
    print(plan.format_plan(result, top=args.top, explained=args.explain))
    _write_json(args.json, result)
    return 0


def cmd_batch_size(args) -> int:
    from . import memory
    from .runtime.launcher import visible_gpus

    if not args.budget_gb > 0:
        raise UsageError(f"--budget-gb {args.budget_gb:g} must be positive.")
    cfg = _config_from(args)
    cfg.validate(runnable=False)
    budget = args.budget_gb * 2**30
    measured = visible_gpus() >= cfg.world_size and cfg.device != "cpu"
    fits = None
    if measured:
        from .train import run

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
    if not found["microbatch"]:
        print(f"not even one sequence per microbatch fits in {args.budget_gb:g} GiB ({how}).")
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

    from . import profiling
    from .gpus import get_gpu
    from .measure import RunResult
    from .replay import ReplayError, replay

    if not os.path.isfile(args.run):
        raise UsageError(f"{args.run} is not a file; give a run saved with 'gpucourse train --json FILE'.")
    try:
        measured = RunResult.load(args.run)
    except (ValueError, TypeError, KeyError) as e:
        raise UsageError(f"{args.run} is not a saved run ({e}).") from None
    if args.json:
        _check_writable(args.json, "--json")
    try:
        modeled = replay(measured, on=args.on, gpus_per_node=args.gpus_per_node, nodes=args.nodes)
    except ReplayError as e:
        raise UsageError(str(e)) from None
    info = modeled.extras["modeled"]
    for note in info["notes"]:
        print(f"gpucourse: note: {note}", file=sys.stderr)
    steps = lambda r: statistics.median(r.step_times_s[1:] or r.step_times_s)  # noqa: E731
    print(f"{measured.world_size} rank(s) of {measured.config['model']}, replayed on {info['cluster']} (modeled)")
    print(f"step time       measured {1e3 * steps(measured):.3f} ms on {measured.device}, "
          f"modeled {1e3 * steps(modeled):.3f} ms")
    print(profiling.format_summary(profiling.summarize(modeled, peak_flops=get_gpu(args.on).peak_flops(
        measured.config.get("precision", "fp32"))), peak_name=f"{args.on} {measured.config.get('precision', 'fp32')}"))
    if args.json:
        modeled.save(args.json)
        print(f"  the modeled run written to {args.json}")
    return 0


def cmd_doctor(args) -> int:
    from . import doctor

    info = doctor.collect()
    print(json.dumps(info, indent=2) if args.json else doctor.format_text(info))
    return 0


def cmd_lab(args) -> int:
    from . import lab

    if not lab.NOTEBOOKS.is_dir():
        raise UsageError(f"the course's notebooks are not at {lab.NOTEBOOKS}: run this from a checkout "
                         f"of the repository (pip install -e .).")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is not a port number (0 to 65535; 0 picks a free one).")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise UsageError("JupyterLab is not installed in this Python: run 'make lab' (or pip install -e .).")
    argv = lab.server_argv(lab.NOTEBOOKS, port=args.port)
    lab.install_course_defaults()  # no news pop-up over the first notebook
    runtime = lab.kernels_runtime_folder()
    if runtime is not None:
        os.environ["JUPYTER_RUNTIME_DIR"] = str(runtime)
    print("gpucourse: serving the course on 127.0.0.1 with a token; open the URL Jupyter prints below.",
          file=sys.stderr, flush=True)
    os.execv(argv[0], argv)


def cmd_bench(args) -> int:
    from . import bench

    only = None
    if args.only is not None:
        only = [key.strip() for key in args.only.split(",") if key.strip()]
        try:
            bench.select(only)
        except ValueError as e:
            raise UsageError(f"--only: {e}") from None
    if args.json:
        _check_writable(args.json, "--json")
    bench.main(quick=args.quick, json_path=args.json, only=only)
    return 0


def cmd_tour(args) -> int:
    if in_place():
        raise UsageError("gpucourse tour starts its own ranks for every layout; run it without torchrun.")
    if args.out:
        _check_writable(args.out, "--out")
    plan_device(args.device, 1)  # a bad --device is refused before anything runs
    from . import tour

    return tour.main(quick=args.quick, out=args.out, device=args.device, only=args.only)


def cmd_grade(args) -> int:
    from .grading import core, report, runner
    for flag, value in (("--timeout", args.timeout), ("--memory-gb", args.memory_gb)):
        if value <= 0:
            raise UsageError(f"{flag} {value:g} must be more than 0.")
    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs} must be at least 1.")
    for key in args.exercises:
        try:
            core.find_exercise(key)
        except KeyError as e:
            raise UsageError(f"{e.args[0]}.") from None
    common = dict(timeout=args.timeout, seed=args.seed, memory_gb=args.memory_gb)
    if args.class_dir:
        if not args.out:
            raise UsageError("--class needs --out FILE.csv, where the grades go.")
        if args.json or args.path:
            raise UsageError("--class grades the learner folders inside it; --json and --path are for one folder "
                             "(each learner's results JSON goes next to the --out file).")
        if not os.path.isdir(args.class_dir):
            raise UsageError(f"--class {args.class_dir} is not a folder.")
        names = runner.learners(args.class_dir)
        if not names:
            raise UsageError(f"--class {args.class_dir} holds no learner folders (one sub-folder per learner).")
        _check_writable(args.out, "--out")
        if runner.results_folder(args.out).exists() and not runner.results_folder(args.out).is_dir():
            raise UsageError(f"{runner.results_folder(args.out)} is a file; the learners' results go in a folder "
                             f"of that name.")
        print(f"grading {len(names)} learner{'s' * (len(names) > 1)} in {args.class_dir}, {args.jobs} at a time")

        def done(name, result):
            print(f"  {name:<24} {result['score']:>4}/{result['max_score']}  ({result['time_s']:.1f} s)", flush=True)

        out = runner.grade_class(args.class_dir, args.out, jobs=args.jobs, exercises=args.exercises or None,
                                 on_learner=done, **common)
        print(f"graded in {out['time_s']:.1f} s (seed {out['seed']}): grades in {out['csv']}, "
              f"each learner's results in {out['results_dir']}/")
        return 0
    if args.out or args.jobs != 1:
        raise UsageError("--out and --jobs are for grading a class (--class DIR).")
    folder = runner.find_folder(args.path)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder of exercises; give one with --path.")
    if args.json:
        _check_writable(args.json, "--json")
    result = runner.grade(folder, args.exercises or None, **common)
    print(report.text_report(result))
    if args.path is None:  # your own exercises/: the scores go to your progress file
        note = runner.record_progress(result)
        if note:
            print(note)
    if args.json:
        write_atomic(args.json, json.dumps(report.gradescope(result), indent=1))
        print(f"results written to {args.json}")
    return 0 if result["score"] == result["max_score"] else 1


def cmd_quiz(args) -> int:
    from . import quiz

    if args.topic is not None and args.topic not in quiz.TOPICS:
        raise UsageError(f"--topic {args.topic!r} is not one of {', '.join(quiz.TOPICS)}.")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count {args.count} must be at least 1.")
    if args.review and (args.exam or args.export):
        raise UsageError("--review asks again the questions you missed; leave out --exam and --export.")
    if args.export:
        _check_writable(args.export, "--export")
        n = quiz.export_bank(args.export, args.topic)
        print(f"{n} questions written to {args.export}")
        return 0
    from .quiz import terminal

    if args.review:
        from . import progress
        from .quiz import review

        try:
            record = progress.load()
            questions = review.draw(record, args.topic, args.count, args.seed)
        except ValueError as e:  # no answers recorded yet, or an unreadable progress file
            raise UsageError(str(e)) from None
        if questions:
            terminal.run_quiz(questions, "review")
        else:
            print(review.nothing_due(record, args.topic))
        return 0
    if args.exam:
        if args.topic:
            raise UsageError("--exam spans every topic; leave out --topic.")
        try:  # at most quiz.most_questions(): the exam's topic weights, single and multiple choice only
            exam = quiz.mock_exam(args.count or 40, args.seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
        terminal.run_exam(exam)
    else:
        terminal.run_quiz(quiz.ask(args.topic, args.count or 10, args.seed), args.topic or "mixed")
    return 0


def cmd_progress(args) -> int:
    from . import progress
    from .quiz import review

    try:
        if args.reset:
            had = progress.reset()
            print(f"progress reset: {progress.progress_path()} {'removed' if had else 'held nothing yet'}.")
            return 0
        summary = review.summary()
    except progress.ProgressError as e:
        raise UsageError(str(e)) from None
    print(json.dumps(summary, indent=1) if args.json else review.format_summary(summary))
    return 0


def cmd_workshop(args) -> int:
    from .workshop import collect, hub, kernels, report
    from .workshop.errors import WorkshopError

    try:
        if args.action == "start":
            if args.public:
                print(f"gpucourse: warning: {hub.PUBLIC_WARNING}", file=sys.stderr)
            users = [u.strip() for u in args.users.split(",") if u.strip()] if args.users else None
            started = hub.start(args.dir, seats=args.seats, gpus_per_seat=args.gpus_per_seat, port=args.port,
                                public=args.public, password=args.password, users=users, admin=args.admin,
                                new_codes=args.new_codes, say=lambda line: print(line, file=sys.stderr, flush=True))
            print(hub.format_started(started))
        elif args.action == "status":
            found = report.status(args.dir)
            print(json.dumps(found, indent=1) if args.json else report.format_report(found))
        elif args.action == "check":
            found = kernels.check(args.dir, seats=args.seat or None, rounds=args.rounds, timeout=args.timeout)
            print(kernels.format_check(found))
            return 1 if found["failed"] else 0
        elif args.action == "collect":
            def done(name, result):
                print(f"  {name:<12} {result['score']:>4}/{result['max_score']}  ({result['time_s']:.1f} s)",
                      flush=True)

            out = collect.collect(args.dir, args.out, gradescope=args.gradescope, exercises=args.exercises or None,
                                  jobs=args.jobs, timeout=args.timeout, on_seat=done)
            print(f"graded {len(out['learners'])} seats in {out['time_s']:.1f} s (seed {out['seed']}): grades in "
                  f"{out['csv']}, each seat's results in {out['results_dir']}/"
                  + (f", Gradescope results.json in {args.gradescope}/<seat>/" if args.gradescope else ""))
        else:
            print(hub.format_stopped(hub.stop(args.dir), args.dir))
    except WorkshopError as e:
        raise UsageError(str(e)) from None
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong flag gets one sentence (``gpucourse: error: ...``), not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help').\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpucourse", description="Run, watch and check distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a layout (dp × tp × pp) and print a summary",
                       description="Train one layout. --batch-size is the global batch per optimizer step.")
    _add_layout_args(p)
    p.add_argument("--json", metavar="FILE", help="write the RunResult as JSON")
    p.add_argument("--export-weights", metavar="FILE", help="save the trained model as one single-device state_dict")
    p.add_argument("--timeout", type=float, default=None, help="seconds before the run is stopped (default: none)")
    p.add_argument("--no-record", action="store_true", help="do not record timeline spans")
    p.add_argument("--save", metavar="DIR", help="save distributed checkpoints into DIR (DIR/step-NNNNNN)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="with --save: a checkpoint every N steps, and one at the end (default 0: only at the end)")
    p.add_argument("--resume", metavar="DIR",
                   help="go on from the newest complete checkpoint in DIR (same model and settings; the layout and "
                        "--steps may change); "
                        "if DIR is also --save and holds none yet, start from step 0")
    p.add_argument("--quiet", action="store_true", help="no progress or device line")
    p.add_argument("--list", action="store_true", help="list the layouts and impls this build supports")
    p.add_argument("--print-config", metavar="TOOL", default=None,
                   help="print this layout as megatron, nemo, deepspeed, torchtitan or accelerate settings (in "
                        "their own names) and exit without training; what the tool cannot express goes to stderr")
    p.add_argument("--profile", metavar="DIR",
                   help="write a torch.profiler Chrome trace per rank (DIR/rankN.trace.json) and print where "
                        "each rank's time went: compute, communication, idle")
    p.add_argument("--memory-snapshot", metavar="DIR",
                   help="on GPUs: record every CUDA allocation of each rank and write DIR/rankN.memory.pickle at the "
                        "end (also after an out-of-memory error), to open in https://pytorch.org/memory_viz")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="one device's peak TFLOP/s, for MFU (model FLOPs utilisation)")
    p.add_argument("--gpu", default=None, help="take the peak for MFU from the GPU table (h100, a100, h200, l4...)")
    p.add_argument("--baseline", metavar="FILE",
                   help="a RunResult JSON of the same model on one rank (train --json): print scaling efficiency")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("schedule", help="lay out a pipeline schedule on a clock, without starting any rank",
                       description="Print a pipeline schedule's per-stage timeline, bubble and activations held.")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step")
    p.add_argument("--schedule", default="1f1b",
                   help="; ".join(f"{name}: {s.summary}" for name, s in SCHEDULES.items()))
    p.add_argument("--virtual-stages", type=int, default=2, help="interleaved-1f1b: model chunks per rank")
    p.add_argument("--cost-f", type=float, default=1.0, help="time of one stage's forward of one microbatch")
    p.add_argument("--cost-b", type=float, default=2.0, help="time of one stage's backward of one microbatch")
    p.add_argument("--cost-comm", type=float, default=0.0, help="time of one activation or gradient transfer")
    p.add_argument("--json", metavar="FILE", help="write the schedule, timeline and figures as JSON")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("tour", help="run every supported layout, check each equals the single-device run, "
                                    "write an HTML report",
                       description="Train every layout of 'gpucourse train --list' here, compare each with the "
                                   "single-device run (loss within 1e-5 relative), print a table and write one "
                                   "self-contained HTML report. Exits 1 if any layout differs.")
    p.add_argument("--out", metavar="FILE", default="gpucourse-tour.html",
                   help="the HTML report (default: gpucourse-tour.html)")
    p.add_argument("--quick", action="store_true", help="tiny runs: 3 steps of 32 tokens (a few minutes on 2 cores)")
    p.add_argument("--only", action="append", metavar="LAYOUT",
                   help="only this layout, as 'layout impl' from 'gpucourse train --list' (repeat for more)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.set_defaults(func=cmd_tour)

    p = sub.add_parser("memory", help="estimate memory per rank for a layout, before it runs",
                       description="Takes the same flags as train; --params N sizes a model of N parameters.")
    _add_layout_args(p)
    p.add_argument("--params", type=float, default=None, help="a parameter count instead of --model (e.g. 70e9)")
    p.add_argument("--json", metavar="FILE", help="write the estimate as JSON")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("plan", help="rank the layouts of a large model on many GPUs, on paper")
    p.add_argument("--params", type=float, help="parameters, e.g. 70e9 (a plausible dense GPT shape is assumed)")
    p.add_argument("--shape", help="a named public shape instead (gpucourse.shapes.SHAPES: gpt3-175b, megatron-1t, "
                                   "llama3-8b, llama3-70b, llama3-405b, mixtral-8x7b, deepseek-v3-like, ...); "
                                   "the flags below change its parts")
    for flag, kind, text in (("--layers", int, "transformer blocks"), ("--hidden", int, "model width"),
                             ("--heads", int, "attention heads"), ("--kv-heads", int, "key/value heads (GQA)"),
                             ("--ffn", int, "MLP width (default 4 × hidden)"), ("--mlp", str, "gelu or swiglu"),
                             ("--vocab", int, "vocabulary"), ("--experts", int, "routed experts per MoE block"),
                             ("--top-k", int, "experts per token"), ("--expert-ffn", int, "an expert's MLP width")):
        p.add_argument(flag, type=kind, default=None, help=f"shape: {text}")
    p.add_argument("--framework", default=None,
                   help="whose overlap of communication with compute to assume: megatron-core (default), "
                        "megatron-core-tp-overlap, megatron-2021, fsdp, ddp")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    p.add_argument("--gpu", default="h100", help="GPU kind from the table (gpucourse.gpus), e.g. h100, a100")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per server (tensor parallelism stays inside)")
    p.add_argument("--batch-size", type=int, default=1024, help="global batch in sequences")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--precision", default="bf16",
                   help="bf16 (with fp32 master weights), fp8 (fp8 matmuls, the rest as bf16) or fp32")
    p.add_argument("--efficiency", type=float, default=None,
                   help="time compute as this fraction of peak FLOP/s, spread evenly (default: kernel by kernel "
                        "on the model's shape)")
    p.add_argument("--top", type=int, default=10, help="rows to print")
    p.add_argument("--explain", action="store_true",
                   help="each row's step as its parts (compute, recompute, bubble, each kind of communication, "
                        "optimizer) and its memory per GPU")
    p.add_argument("--json", metavar="FILE", help="write every layout as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("batch-size", help="the largest microbatch that fits a memory budget",
                       description="Bisection: measured on CUDA, estimated on CPU against the budget.")
    _add_layout_args(p)
    p.add_argument("--budget-gb", type=float, required=True, help="memory per rank, GiB")
    p.set_defaults(func=cmd_batch_size)

    p = sub.add_parser("bandwidth", help="time collectives over message sizes: algorithm and bus bandwidth",
                       description="Times each collective at each size the way nccl-tests does (busbw = algbw x "
                                   "2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for "
                                   "broadcast) and a memory copy of the largest size on one rank.")
    p.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--ops", default=None,
                   help="comma-separated, of all_reduce, all_gather, reduce_scatter, broadcast (default: all)")
    p.add_argument("--sizes", default=None, help="comma-separated message sizes, e.g. 1K,64K,1M,64M "
                                                 "(default 1 KB to 64 MB, x4 each step)")
    p.add_argument("--quick", action="store_true", help="four sizes and short timings")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.set_defaults(func=cmd_bandwidth)

    p = sub.add_parser("troubleshoot", help="planted faults: see a hang, a crash, a NaN, an OOM, then the fix",
                       description="Runs a small training with one fault planted and prints the symptom, the "
                                   "diagnosis and the fix.")
    p.add_argument("name", nargs="?", help="the scenario to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.set_defaults(func=cmd_troubleshoot)

    p = sub.add_parser("replay", help="replay a saved run on a modeled GPU cluster: its step time, shares and MFU there",
                       description="Lay a run's recorded work (train --json FILE) out on modeled GPUs: each "
                                   "forward and backward timed from its FLOPs, each collective by an alpha-beta "
                                   "model over the link it crosses (docs/modeled-timing.md).")
    p.add_argument("run", metavar="RUN.json", help="a run saved with 'gpucourse train --json FILE'")
    p.add_argument("--on", default="h100", help="GPU kind from the table (gpucourse.gpus): a100, h100, h200, b200, l4")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per server (default 8)")
    p.add_argument("--nodes", type=int, default=None, help="servers (default: as many as the run's ranks need)")
    p.add_argument("--json", metavar="FILE", help="also write the modeled run as JSON")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("doctor", help="what this machine has for distributed training")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("lab", help="open the course in JupyterLab (what 'make lab' runs)",
                       description="Serve notebooks/ with JupyterLab on 127.0.0.1, behind a token.")
    p.add_argument("--port", type=int, default=8888, help="port (default 8888; Jupyter takes the next free one "
                                                          "if it is busy; 0 picks any free port)")
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("bench", help="benchmarks: ratios against the PyTorch counterparts, measured side by side")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--only", metavar="KEY[,KEY...]", help="measure only these figures (e.g. zero_memory_vs_formula)")
    p.set_defaults(func=cmd_bench)

    from .grading.runner import DEFAULT_MEMORY_GB, DEFAULT_TIMEOUT_S

    p = sub.add_parser("grade", help="grade the exercises: each check, its hint, the score",
                       description="Grade exercises/ (or --path DIR), or a whole class (--class DIR). "
                                   "Exit status: 0 when every check passed (or a class was graded), 1 otherwise.")
    p.add_argument("exercises", nargs="*", metavar="EXERCISE", help="which ones (ex03, or 3); default all")
    p.add_argument("--path", metavar="DIR",
                   help="folder to grade (default: exercises/ here or above, else the repository's; only that "
                        "default records the scores in your progress file)")
    p.add_argument("--json", metavar="FILE", help="also write the results in Gradescope's results.json format")
    p.add_argument("--class", dest="class_dir", metavar="DIR",
                   help="grade every learner folder in DIR (one sub-folder per learner)")
    p.add_argument("--out", metavar="FILE.csv",
                   help="with --class: one row per learner, one column per exercise, and the total; each "
                        "learner's results JSON goes to FILE-results/")
    p.add_argument("--jobs", type=int, default=1, help="with --class: learners graded at a time (default 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"seconds each check's code may take on a quiet machine (default {DEFAULT_TIMEOUT_S:g}); "
                        f"scaled up by how loaded the machine is, and starting ranks is not counted")
    p.add_argument("--memory-gb", type=float, default=DEFAULT_MEMORY_GB, metavar="G",
                   help=f"address space each exercise's processes may use (default {DEFAULT_MEMORY_GB:g} GiB)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the checks' random inputs (default: fresh each run; failures print it)")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("quiz", help="exam-style questions with explanations; a timed mock exam",
                       description="Ask questions in the terminal, say at once whether each answer is right and "
                                   "why, and record the score (see 'gpucourse progress'). Topics: "
                                   "distributed-setups, parallelism, memory-batch, profiling-troubleshooting.")
    p.add_argument("--topic", default=None, help="one topic (default: all)")
    p.add_argument("--count", type=int, default=None, help="questions to ask (default 10; 40 with --exam)")
    p.add_argument("--seed", type=int, default=None, help="draw the same questions again")
    p.add_argument("--exam", action="store_true",
                   help="a mock exam across all topics, timed (90 s a question), marked at the end")
    p.add_argument("--export", metavar="FILE",
                   help="write the whole bank (or --topic's questions) as JSON, with answers and explanations")
    p.add_argument("--review", action="store_true",
                   help="ask again the questions you missed, spaced over sessions (Leitner boxes): a missed question "
                        "comes back next session; each right answer moves it up a box, and boxes 1-5 wait 1, 2, 4, "
                        "8, 16 sessions (a session is one finished quiz, review or mock exam)")
    p.set_defaults(func=cmd_quiz)

    p = sub.add_parser("progress", help="exercises passed and quiz scores so far",
                       description="Read the progress file (~/.gpucourse/progress.json, or $GPUCOURSE_PROGRESS) "
                                   "that 'gpucourse grade' and the quizzes write.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--reset", action="store_true", help="forget all progress (removes the file)")
    p.set_defaults(func=cmd_progress)

    p = sub.add_parser("workshop", help="run the course for a class: JupyterHub seats, a dashboard, grading",
                       description="A JupyterHub on this machine with one seat per learner: its own copy of the "
                                   "course, progress file and GPUs. The workshop lives in --dir (default "
                                   "~/.gpucourse/workshop, or $GPUCOURSE_WORKSHOP).")
    actions = p.add_subparsers(dest="action", required=True)
    w = actions.add_parser("start", help="start (or resume) the hub and every seat's JupyterLab")
    w.add_argument("--seats", type=int, default=None, help="learners (a new workshop needs it; resuming keeps them)")
    w.add_argument("--gpus-per-seat", type=int, default=None, metavar="K",
                   help="GPUs for each seat (default: the visible GPUs shared evenly; 0: CPU seats)")
    w.add_argument("--port", type=int, default=8000, help="the hub's port (default 8000)")
    w.add_argument("--public", action="store_true", help="listen on every interface, not only 127.0.0.1")
    w.add_argument("--password", action="store_true",
                   help="one workshop password for every seat instead of a code per seat")
    w.add_argument("--users", metavar="NAME[,NAME...]",
                   help="real accounts of this machine as the seats (PAM login, servers run as them; needs root)")
    w.add_argument("--admin", metavar="NAME", help="with --users: the instructor's account (default: yours)")
    w.add_argument("--new-codes", action="store_true", help="new codes (or password) instead of the same ones")
    w = actions.add_parser("status", help="each seat's progress, what to explain next, GPU use")
    w.add_argument("--json", action="store_true", help="print JSON")
    w = actions.add_parser("check", help="open a notebook in every seat at once and run a cell: do the kernels work?",
                           description="What a class does at 9:00, done before it: a kernel in every seat (or "
                                       "those named), all started in the same moment through the hub, each running "
                                       "one cell, then shut down. Exit status 1 when a seat failed; its server's "
                                       "log is printed.")
    w.add_argument("seat", nargs="*", help="which seats (default: all)")
    w.add_argument("--rounds", type=int, default=1, help="how many times (default 1)")
    w.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds for each seat's kernel to start and run the cell (default 120)")
    w = actions.add_parser("collect", help="grade every seat's exercises into one CSV")
    w.add_argument("exercises", nargs="*", metavar="EXERCISE", help="which ones (ex03, or 3); default all")
    w.add_argument("--out", default="grades.csv", metavar="FILE.csv",
                   help="one row per seat (default grades.csv); each seat's results JSON goes to FILE-results/")
    w.add_argument("--gradescope", metavar="DIR", help="also write DIR/<seat>/results.json for Gradescope")
    w.add_argument("--jobs", type=int, default=None, help="seats graded at a time (default: cores ÷ 4, at least 1)")
    w.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds per check (as grade --timeout)")
    actions.add_parser("stop", help="stop the hub and every seat's server; keep every seat's work")
    for w in actions.choices.values():
        w.add_argument("--dir", default=None, help="the workshop's folder")
    p.set_defaults(func=cmd_workshop)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``gpucourse`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, LaunchError, UsageError) as e:
        print(f"gpucourse: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:
        print(f"gpucourse: {e}", file=sys.stderr)
        return 1
    except LaunchTimeout as e:
        print(f"gpucourse: timeout: {e}", file=sys.stderr)
        if e.waiting:
            from .runtime.collective_status import diagnose_hang

            print(f"gpucourse: diagnosis: {diagnose_hang(e.waiting)}", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        print("gpucourse: interrupted; every rank was stopped.", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
