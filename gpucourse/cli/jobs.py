"""``gpucourse submit``: a training run as a SLURM job over several nodes, and what became of it (gpucourse.course.slurm)."""

from __future__ import annotations

import math
import re
import sys

from ..course import slurm
from ..config import TrainConfig
from ..parallel import check
from ..values import NON_NEGATIVE, POSITIVE
from .common import UsageError, add_layout_args, check_writable, config_from, layout_flags
from .train import add_output_args


def _job_id(text: str) -> str:
    if not re.fullmatch(r"\d+(_\d+)?", text):
        raise UsageError(f"{text!r} is not a job id: give the number gpucourse submit or squeue printed.")
    return text


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _train_flags(args, cfg: TrainConfig) -> list[str]:
    """The ``gpucourse train`` flags each node runs: the layout and run options, then what the run writes."""
    flags = layout_flags(cfg, train=True)
    for flag, value in (("--json", args.json), ("--export-weights", args.export_weights), ("--timeout", args.timeout)):
        if value is not None:
            flags += [flag, f"{value:g}" if isinstance(value, float) else value]
    return flags + (["--quiet"] if args.quiet else [])


def _request(args) -> tuple[slurm.Request, TrainConfig]:
    """The job the flags describe and the run's config; what needs no cluster to refuse is refused here."""
    cfg = config_from(args)
    if args.nodes < 1 or args.gpus_per_node < 0 or (args.procs_per_node is not None and args.procs_per_node < 1):
        raise UsageError("--nodes and --procs-per-node must be 1 or more, --gpus-per-node 0 or more.")
    procs = args.procs_per_node or args.gpus_per_node or 1
    if args.gpus_per_node and procs != args.gpus_per_node:
        raise UsageError(f"--procs-per-node {procs} with --gpus-per-node {args.gpus_per_node}: a node runs one rank "
                         f"per GPU; leave --procs-per-node out.")
    ranks = args.nodes * procs
    if cfg.world_size != ranks:
        raise UsageError(f"{args.nodes} node{'s' * (args.nodes > 1)} × {procs} rank{'s' * (procs > 1)} per node = "
                         f"{ranks} ranks, but the layout's pp × dp × cp × tp = {cfg.world_size}; make them equal "
                         f"(e.g. --dp {ranks}).")
    if cfg.device == "auto":  # said plainly in the script: the nodes' GPUs, or CPU ranks over gloo
        cfg.device = "cuda" if args.gpus_per_node else "cpu"
    check(cfg)
    cfg.validate_on(cfg.device)
    if cfg.save and not cfg.resume:  # a resubmission goes on from the last checkpoint (the first starts at step 0)
        cfg.resume = cfg.save
    for path, flag in ((args.json, "--json"), (args.export_weights, "--export-weights")):
        if path:
            check_writable(path, flag)
    if args.time:
        time_s = slurm.parse_time(args.time)
        if time_s is None:
            raise UsageError(f"--time {args.time} cannot be checked against the run: give minutes or HH:MM:SS.")
    else:
        time_s = math.ceil(slurm.time_needed_s(cfg, args.gpus_per_node) / 60) * 60
    request = slurm.Request(train=_train_flags(args, cfg), nodes=args.nodes, procs_per_node=procs,
                            gpus_per_node=args.gpus_per_node, time_s=time_s, partition=args.partition,
                            name=args.job_name)
    return request, cfg


def _say_state(info: dict) -> None:
    where = f" on {info['NodeList']}" if slurm.state(info) == "RUNNING" else ""
    why = f" ({info['Reason']})" if info.get("Reason", "None") != "None" else ""
    print(f"job {info['JobId']}: {slurm.state(info)}{where}{why}", file=sys.stderr)


def _status(job_id: str, wait: bool) -> int:
    """How the job is doing, or (``wait``) how it ended: its log when it completed, why when it did not."""
    info = slurm.wait(job_id, _say_state) if wait else slurm.job(job_id)
    state, log = slurm.state(info), slurm.log_path(job_id, info)
    if state not in slurm.ENDED:
        running = f" on {info['NodeList']}, {info['RunTime']} of {info['TimeLimit']}" if state == "RUNNING" else ""
        print(f"job {job_id}: {state}{running}")
        return 0
    if state == "COMPLETED":
        if wait:
            print(_read(log) or f"job {job_id} completed; its log {log} is not readable here.\n", end="")
        else:
            print(f"job {job_id}: COMPLETED; its output: gpucourse submit --logs {job_id}")
        return 0
    why = slurm.diagnosis(job_id, info, _read(log) or "", slurm.train_flags(job_id))
    if not wait:
        print(why)
        return 0
    print(f"gpucourse: {why}", file=sys.stderr)
    return slurm.exit_status(info)


def _about_job(args) -> int:
    """--status, --logs or --cancel of a job submitted before."""
    if args.cancel:
        job_id = _job_id(args.cancel)
        slurm.cancel(job_id)
        print(f"job {job_id}: cancelled")
        return _status(job_id, wait=True) if args.wait else 0
    if args.logs:
        job_id = _job_id(args.logs)
        try:
            info = slurm.job(job_id)
        except slurm.SlurmError:  # forgotten by SLURM: its log may still be here
            info = {}
        path = slurm.log_path(job_id, info)
        text = _read(path)
        if text is None:
            raise UsageError(f"job {job_id}'s log {path} cannot be read (a job that has not started has none).")
        print(text, end="")
        return 0
    return _status(_job_id(args.status), args.wait)


def cmd_submit(args) -> int:
    try:
        if args.status or args.logs or args.cancel:
            return _about_job(args)
        request, cfg = _request(args)
        script = slurm.batch_script(request)
        if args.dry_run:
            print(script, end="")
            return 0
        slurm.check(request, cfg)
        job_id = slurm.submit(script)
        print(f"submitted job {job_id} ({request.nodes} × {request.procs_per_node} ranks), log "
              f"{slurm.log_path(job_id)}: gpucourse submit --status {job_id} (or --logs, --cancel)", file=sys.stderr)
        print(job_id)
        return _status(job_id, wait=True) if args.wait else 0
    except slurm.SlurmError as e:
        raise UsageError(str(e)) from None


def add_commands(sub) -> None:
    """This group's subcommands, on the ``gpucourse`` parser's ``sub``."""
    p = sub.add_parser("submit", help="train a layout as a SLURM job over several nodes",
                       description="Write an sbatch script that runs 'gpucourse train' over several nodes (one "
                                   "torchrun per node) and submit it, checked against the cluster first; or report "
                                   "on, print the log of, or cancel a job.")
    add_layout_args(p, train=True)
    add_output_args(p)
    job = p.add_argument_group("the job")
    job.add_argument("--nodes", type=POSITIVE, default=1, metavar="N", help="nodes, one torchrun each (default 1)")
    job.add_argument("--gpus-per-node", type=NON_NEGATIVE, default=0, metavar="N",
                     help="GPUs per node, one rank each (default 0: CPU ranks over gloo)")
    job.add_argument("--procs-per-node", type=POSITIVE, default=None, metavar="N",
                     help="ranks per node on CPU nodes (default: one per GPU, or 1)")
    job.add_argument("--partition", default=None, metavar="NAME",
                     help="SLURM partition (default: the cluster's default)")
    job.add_argument("--time", default=None, metavar="LIMIT",
                     help=f"time limit: minutes, HH:MM:SS or D-HH:MM:SS (default: what the run needs by the rule "
                          f"{slurm.TIME_RULE}; a shorter limit is refused)")
    job.add_argument("--job-name", default="gpucourse", metavar="NAME",
                     help="the job's name in squeue (default gpucourse)")
    job.add_argument("--dry-run", action="store_true", help="print the sbatch script; ask and submit nothing")
    job.add_argument("--wait", action="store_true",
                     help="wait until the job ends, then print its log (or why it failed) and exit with its status")
    about = job.add_mutually_exclusive_group()
    about.add_argument("--status", metavar="JOB", help="say how job JOB is doing (with --wait: how it ended)")
    about.add_argument("--logs", metavar="JOB", help="print job JOB's output")
    about.add_argument("--cancel", metavar="JOB", help="cancel job JOB")
    p.set_defaults(func=cmd_submit)
