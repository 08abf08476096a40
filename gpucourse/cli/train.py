"""``gpucourse train``: one layout trained, with a progress bar and a summary, or printed as another tool's settings."""

from __future__ import annotations

import os
import sys

from ..config import TrainConfig
from ..parallel import check
from ..parallel.catalogue import supported_table
from ..readable import human_bytes
from ..runtime.launcher import check_in_place_world, in_place, plan_device
from ..modeled.gpus import GPU
from ..interop.stack_config import TOOLS as STACKS
from ..values import GPUS_PER_NODE, POSITIVE_NUMBER, Name
from .common import SAVED_RUN, ProgressBar, UsageError, add_layout_args, check_writable, config_from


def _step_bar(bar: ProgressBar):
    """A training run's ``on_step``: the bar, with each step's loss and time."""
    def on_step(s: dict) -> None:
        bar(s["step"] + 1, s["steps"], f"loss {s['loss']:.4f}  {s['time_s'] * 1e3:7.1f} ms/step")
    return on_step


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
    cfg = config_from(args)
    if args.print_config is not None:  # the same layout in another tool's names; nothing trains
        return _print_stack_config(cfg, args.print_config, args.gpus_per_node)
    if args.gpus_per_node is not None:
        raise UsageError("--gpus-per-node places a layout's ranks on servers for --print-config; a run here takes "
                         "the GPUs this machine has.")
    check(cfg)
    for path, flag in ((args.json, "--json"), (args.export_weights, "--export-weights")):
        if path:
            check_writable(path, flag)
    plan = None
    if in_place():
        check_in_place_world(cfg.world_size, "pp × dp × cp × tp")
    else:  # planned here, to refuse before anything else, and handed to the run
        plan = plan_device(cfg.device, cfg.world_size)
        cfg.validate_on(plan.device)
    analysis = _profile_options(args, cfg)
    if cfg.memory_snapshot:
        _check_folder(cfg.memory_snapshot, "--memory-snapshot", "the snapshots")

    from ..train import run

    rank0 = not in_place() or int(os.environ["RANK"]) == 0
    result = run(cfg, timeout=args.timeout, export_weights=args.export_weights,
                 on_step=None if args.quiet else _step_bar(ProgressBar()), quiet=args.quiet,
                 device_plan=plan)
    cfg = TrainConfig.from_dict(result.config)  # as it ran: the device planned, precision "auto" made one
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
            from ..profiling import snapshot_path

            paths = ", ".join(snapshot_path(cfg.memory_snapshot, r) for r in range(result.world_size))
            print(f"  memory snapshots: {paths} (open in https://pytorch.org/memory_viz)")
    return 0


def _print_stack_config(cfg: TrainConfig, tool: str, gpus_per_node: int | None = None) -> int:
    """Print ``cfg`` as ``tool``'s settings on stdout; what the tool cannot express, one note a line, on stderr."""
    from ..interop import stack_config

    if tool not in stack_config.TOOLS:
        raise UsageError(f"--print-config {tool!r} is not one of {', '.join(stack_config.TOOLS)}.")
    try:
        out = stack_config.translate(cfg, tool, gpus_per_node)
    except ValueError as e:
        raise UsageError(str(e).replace("gpus_per_node", "--gpus-per-node")) from None
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
        peak, name = args.peak_tflops * 1e12, "--peak-tflops"
    elif args.gpu:
        from ..modeled.gpus import get_gpu

        spec = get_gpu(args.gpu)
        peak, name = spec.peak_flops(cfg.precision), f"{spec.name} {'fp32' if cfg.precision == 'fp32' else 'bf16'} peak"
    return peak, name, args.baseline  # the baseline run was read as its flag was parsed


def _print_profile(result, cfg: TrainConfig, peak, name, baseline) -> None:
    from .. import profiling

    print()
    print(profiling.format_summary(profiling.summarize(result, peak_flops=peak, baseline=baseline), name))
    if cfg.profile:
        print(f"traces: {', '.join(profiling.trace_path(cfg.profile, r) for r in range(result.world_size))} "
              f"(open in https://ui.perfetto.dev or chrome://tracing)")


def add_output_args(p) -> None:
    """What a run writes and how long it may take: flags of ``gpucourse train`` that ``gpucourse submit`` passes on."""
    p.add_argument("--json", metavar="FILE", help="write the RunResult as JSON")
    p.add_argument("--export-weights", metavar="FILE", help="save the trained model as one single-device state_dict")
    p.add_argument("--timeout", type=POSITIVE_NUMBER, default=None,
                   help="seconds before the run is stopped (default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress or device line")


def add_commands(sub) -> None:
    """This group's subcommands, on the ``gpucourse`` parser's ``sub``."""
    p = sub.add_parser("train", help="train a layout (dp × tp × pp) and print a summary",
                       description="Train one layout. --batch-size is the global batch per optimizer step.")
    add_layout_args(p, train=True)
    add_output_args(p)
    p.add_argument("--list", action="store_true", help="list the layouts and impls this build supports")
    p.add_argument("--print-config", type=Name(STACKS), metavar="TOOL", default=None,
                   help="print this layout as megatron, nemo, deepspeed, torchtitan or accelerate settings (in "
                        "their own names) and exit without training; what the tool cannot express goes to stderr")
    p.add_argument("--gpus-per-node", type=GPUS_PER_NODE, default=None, metavar="G",
                   help="with --print-config: the servers' GPUs each, so that each tool's fields for servers and "
                        "GPUs per server are written (default: one server holds the whole layout)")
    p.add_argument("--peak-tflops", type=POSITIVE_NUMBER, default=None,
                   help="one device's peak TFLOP/s, for MFU (model FLOPs utilisation)")
    p.add_argument("--gpu", type=GPU, default=None,
                   help="take the peak for MFU from the GPU table (h100, a100, h200, l4...)")
    p.add_argument("--baseline", type=SAVED_RUN, metavar="FILE",
                   help="a RunResult JSON of the same model on one rank (train --json): print scaling efficiency")
    p.set_defaults(func=cmd_train)
