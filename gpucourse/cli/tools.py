"""The commands that measure this machine or show faults: ``bandwidth``, ``troubleshoot``, ``doctor``, ``bench``,
``tour``."""

from __future__ import annotations

import json

from ..runtime.launcher import in_place, plan_device
from ..config import DEVICES
from ..values import Name, whole
from .common import UsageError, check_writable, write_json


def cmd_bandwidth(args) -> int:
    from ..course import bandwidth

    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops is not None else list(bandwidth.OPS)
    bad = [o for o in ops if o not in bandwidth.OPS]
    if bad or not ops:
        raise UsageError(f"--ops {args.ops!r}: each must be one of {', '.join(bandwidth.OPS)}.")
    try:
        sizes = [bandwidth.parse_size(x) for x in args.sizes.split(",")] if args.sizes else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        check_writable(args.json, "--json")
    plan_device(args.device, args.world_size)  # refused before anything runs
    sizes = sizes or list(bandwidth.QUICK_SIZES if args.quick else bandwidth.SIZES)
    measured = bandwidth.measure(args.world_size, ops, sizes, quick=args.quick, device=args.device,
                                 copy_bytes=max(sizes), quiet=False)
    print(bandwidth.format_table(measured))
    write_json(args.json, measured)
    return 0


def cmd_troubleshoot(args) -> int:
    from ..course import troubleshoot

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


def cmd_doctor(args) -> int:
    from ..course import doctor

    info = doctor.collect()
    print(json.dumps(info, indent=2) if args.json else doctor.format_text(info))
    return 0


def cmd_bench(args) -> int:
    from .. import bench

    only = None
    if args.only is not None:
        only = [key.strip() for key in args.only.split(",") if key.strip()]
        try:
            bench.select(only)
        except ValueError as e:
            raise UsageError(f"--only: {e}") from None
    if args.json:
        check_writable(args.json, "--json")
    bench.main(quick=args.quick, json_path=args.json, only=only)
    return 0


def cmd_tour(args) -> int:
    if in_place():
        raise UsageError("gpucourse tour starts its own ranks for every layout; run it without torchrun.")
    if args.out:
        check_writable(args.out, "--out")
    plan_device(args.device, 1)  # a bad --device is refused before anything runs
    from ..course import tour

    return tour.main(quick=args.quick, out=args.out, device=args.device, only=args.only)


def add_commands(sub) -> None:
    """This group's subcommands, on the ``gpucourse`` parser's ``sub``."""
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
    p.add_argument("--device", type=Name(DEVICES), default="auto", help="auto, cpu or cuda")
    p.set_defaults(func=cmd_tour)

    p = sub.add_parser("bandwidth", help="time collectives over message sizes: algorithm and bus bandwidth",
                       description="Times each collective at each size the way nccl-tests does (busbw = algbw x "
                                   "2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for "
                                   "broadcast) and a memory copy of the largest size on one rank.")
    p.add_argument("--world-size", type=whole(least=2), default=2, help="ranks (default 2)")
    p.add_argument("--ops", default=None,
                   help="comma-separated, of all_reduce, all_gather, reduce_scatter, broadcast (default: all)")
    p.add_argument("--sizes", default=None, help="comma-separated message sizes, e.g. 1K,64K,1M,64M "
                                                 "(default 1 KB to 64 MB, x4 each step)")
    p.add_argument("--quick", action="store_true", help="four sizes and short timings")
    p.add_argument("--device", type=Name(DEVICES), default="auto", help="auto, cpu or cuda")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.set_defaults(func=cmd_bandwidth)

    p = sub.add_parser("troubleshoot", help="planted faults: see a hang, a crash, a NaN, an OOM, then the fix",
                       description="Runs a small training with one fault planted and prints the symptom, the "
                                   "diagnosis and the fix.")
    p.add_argument("name", nargs="?", help="the scenario to run (see --list)")
    p.add_argument("--list", action="store_true", help="list the scenarios")
    p.set_defaults(func=cmd_troubleshoot)

    p = sub.add_parser("doctor", help="what this machine has for distributed training")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", help="benchmarks: ratios against the PyTorch counterparts, measured side by side")
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--only", metavar="KEY[,KEY...]", help="measure only these figures (e.g. zero_memory_vs_formula)")
    p.set_defaults(func=cmd_bench)
