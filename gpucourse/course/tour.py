"""The tour: every layout this build supports, run here, each checked against the single-device run.

``gpucourse tour`` trains each row of ``gpucourse train --list`` (from its own
example command) with the same seed and global batch, on GPUs where there are
enough and on CPU processes ('virtual GPUs') otherwise. Equality is the oracle:
each layout's loss must match the single-device run's at every step, within
1e-5 relative in fp32. It prints a table, writes one HTML report that opens
from disk with every figure of :mod:`gpucourse.viz`, and fails if any layout differs.
"""

from __future__ import annotations

import datetime
import html
import sys
import time
from dataclasses import dataclass

import torch

from ..config import ConfigError, TrainConfig
from ..files import write_atomic
from ..parallel import check
from ..parallel.catalogue import supported
from ..runtime import LaunchError, LaunchTimeout, WorkerError, plan_device, visible_gpus
from ..runtime.launcher import preimport

TOLERANCE = 1e-5                        # relative, per step, fp32
QUICK = dict(steps=3, seq_len=32)       # the tiny model's global batch of 8 sequences stays
FULL = dict(steps=20)
RUN_TIMEOUT_S = {True: 120, False: 600}  # per layout, quick or not: a hung layout fails, the tour goes on
BANDWIDTH_SIZES = tuple(4 ** k * 1024 for k in range(7))   # 1 KiB … 4 MiB
BANDWIDTH_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass
class TourRow:
    """One layout of the tour: its config, what happened (ok, DIFFERS, failed, skipped) and why."""

    layout: str
    impl: str
    config: TrainConfig
    status: str = "skipped"
    note: str = ""
    result: object = None
    max_difference: float | None = None
    seconds: float = 0.0

    @property
    def name(self) -> str:
        """``layout impl`` as in ``gpucourse train --list``."""
        return f"{self.layout} {self.impl}"


def layouts(settings: dict | None = None, device: str = "auto") -> list[TourRow]:
    """Every supported layout as a row, with its config (``settings`` applied on top)."""
    return [TourRow(layout, impl, TrainConfig(**{**changes, "device": device, **(settings or {})}))
            for layout, impl, _, changes in supported()]


def relative_difference(losses, baseline) -> float:
    """The largest ``|loss - baseline| / |baseline|`` over the steps."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, baseline))


def _model(cfg: TrainConfig) -> tuple:
    """What makes two layouts the same model (and so the same single-device run)."""
    mc = cfg.model_config()
    return mc.moe_experts, mc.moe_top_k, mc.moe_every


def _check(row: TourRow) -> bool:
    """Refuse, before starting anything, what this build or this machine cannot run; the sentence says why."""
    try:
        check(row.config)
        row.config.validate_on(plan_device(row.config.device, row.config.world_size).device)
    except (ConfigError, LaunchError) as e:
        row.status, row.note = "skipped", str(e)
        return False
    return True


def _train(row: TourRow, baseline, timeout: float) -> None:
    from ..train import run

    start = time.perf_counter()
    try:
        row.result = run(row.config, timeout=timeout, quiet=True)
    except (WorkerError, LaunchTimeout) as e:
        row.status, row.note = "failed", str(e).splitlines()[0]
        return
    finally:
        row.seconds = time.perf_counter() - start
    reference = baseline if baseline is not None else row.result  # the baseline itself differs by 0
    row.max_difference = relative_difference(row.result.losses, reference.losses)
    row.status = "ok" if row.max_difference <= TOLERANCE else "DIFFERS"
    if row.status == "DIFFERS":
        row.note = f"loss differs from the single-device run by {row.max_difference:.2e} (relative; limit {TOLERANCE:g})"


def peak_memory(result) -> int:
    """The most bytes one rank held: the device's own peak where recorded, else the sum of the categories."""
    peaks = [max([v for k, v in m.items() if "peak" in k], default=sum(v for k, v in m.items() if "peak" not in k))
             for m in result.memory.values()]
    return max(peaks, default=0)


TABLE_HEADER = ["layout", "impl", "world size", "final loss", "max difference", "tokens/s", "comm bytes/step",
                "peak memory/rank", "result"]


def table_rows(rows: list[TourRow]) -> list[list[str]]:
    """The tour's table, one list of cells per layout that ran or failed."""
    from ..viz.style import human_bytes, layout_label

    out = []
    for row in rows:
        if row.status == "skipped":
            continue
        r = row.result
        if r is None:
            out.append([layout_label(row.config), row.impl, str(row.config.world_size), "-", "-", "-", "-", "-",
                        row.status])
            continue
        steps = max(len(r.losses), 1)
        out.append([layout_label(row.config), row.impl, f"{r.world_size} {r.device}", f"{r.losses[-1]:.6f}",
                    f"{row.max_difference:.1e}", f"{r.tokens_per_s:,.0f}",
                    human_bytes(sum(r.comm_bytes.get("per_step", [])) / steps), human_bytes(peak_memory(r)),
                    row.status])
    return out


def format_table(rows: list[TourRow]) -> str:
    """The table ``gpucourse tour`` prints, then one line per skipped or failed layout saying why."""
    cells = [TABLE_HEADER] + table_rows(rows)
    widths = [max(len(c[i]) for c in cells) for i in range(len(TABLE_HEADER))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cell, widths))).rstrip()
             for cell in cells]
    for row in rows:
        if row.note:
            lines.append(f"{row.status}: {row.name}: {row.note}")
    return "\n".join(lines)


# --- the tour --------------------------------------------------------------------------


def run_tour(quick: bool = True, only=None, device: str = "auto", stream=sys.stderr) -> list[TourRow]:
    """Train every supported layout (or those named in ``only``, as ``"layout impl"``) and check each.

    The single-device run always runs first: it is the baseline. Progress goes
    to ``stream``, one line per layout.
    """
    preimport()  # what every rank's first AdamW imports, once, before ranks are forked
    rows = layouts(QUICK if quick else FULL, device)
    # One single-device run per model: the dense one, and the mixture of experts' (each runs before its layouts).
    bases = {_model(r.config): r for r in rows if r.config.world_size == 1}
    if only is not None:
        names = set(only)
        unknown = names - {r.name for r in rows}
        if unknown:
            raise ConfigError(f"{', '.join(sorted(unknown))} is not a layout of this build; see gpucourse train --list.")
        needed = {id(bases[_model(r.config)]) for r in rows if r.name in names}
        rows = [r for r in rows if id(r) in needed or r.name in names]
    baselines = {}
    for i, row in enumerate(rows, start=1):
        base = bases[_model(row.config)]
        if row is not base and baselines.get(id(base)) is None:
            row.status, row.note = "failed", "not run: the single-device run it is checked against failed"
        elif _check(row):
            _train(row, baselines.get(id(base)), RUN_TIMEOUT_S[quick])
            if row is base:
                baselines[id(base)] = row.result
        stream.write(f"tour {i:>2}/{len(rows)}  {row.name:<18} {row.status:<8} {row.seconds:5.1f} s"
                     + (f"  ({row.note.splitlines()[0][:90]})" if row.note else "") + "\n")
        stream.flush()
    return rows


def _pick(rows: list[TourRow], *tests):
    """The result of the first row that ran and passes one of ``tests`` (tried in order)."""
    done = [r for r in rows if r.result is not None]
    for test in tests:
        for row in done:
            if test(row):
                return row.result
    return None


def figures(rows: list[TourRow], bandwidth_rows) -> list[tuple[str, str, str, object]]:
    """The report's figures as ``(id, heading, note, figure)``: the runs' first, then the simulations."""
    from .. import viz
    from ..model import build_model
    from ..parallel.zero import memory_formula
    from ..viz.style import run_label

    out = []
    done = [r for r in rows if r.result is not None]
    baseline = _pick(rows, lambda r: r.layout == "single")
    if baseline is not None:
        pipe = _pick(rows, lambda r: r.layout == "pp" and r.impl == "scratch", lambda r: r.config.pp > 1)
        shown = pipe or _pick(rows, lambda r: r.config.world_size > 1) or baseline
        zero = _pick(rows, lambda r: r.layout == "zero2" and r.impl == "scratch",
                     lambda r: r.config.tp == r.config.pp == 1 and r.config.zero < 3 and r.impl == "scratch")
        cfg = TrainConfig.from_dict(zero.config)
        params = sum(p.numel() for p in build_model(cfg.model_config(), cfg.seed).parameters())
        out.append(("compare", "Every layout, one loss trajectory",
                    "The single-device run is the baseline; the lower panel is each layout's distance from it.",
                    viz.compare([baseline] + [r.result for r in done if r.result is not baseline])))
        out.append(("timeline", f"What each rank did in the last step of {run_label(shown)}",
                    "One bar per recorded span, numbered by microbatch; shaded time is idle.",
                    viz.timeline(shown, steps=len(shown.losses) - 1)))
        if pipe is not None:
            out.append(("schedule-measured", f"The schedule of {run_label(pipe)}, with its measured costs",
                        "Each stage's median forward and backward time, laid out by the simulator.",
                        viz.schedule(pipe)))
        out.append(("memory", f"Memory per rank of {run_label(zero)}, measured beside the formula",
                    "Hatched: gpucourse.parallel.zero.memory_formula. ZeRO shards what data parallelism copies.",
                    viz.memory(zero, predicted=memory_formula(params, cfg.dp, cfg.zero))))
        out.append(("scaling", "Throughput and scaling efficiency",
                    "On CPU processes sharing a few cores, efficiency falls with world size: the ranks compete "
                    "for the cores.", viz.scaling([r.result for r in done])))
    out.append(("schedule", "A 1F1B pipeline schedule, simulated: 4 stages, 8 microbatches",
                "No processes: the simulator lays the schedule on a clock. Drag the slider to change the number "
                "of microbatches.", viz.schedule(pp=4, microbatches=8, schedule="1f1b")))
    for op in BANDWIDTH_OPS:
        out.append((f"collective-{op}", f"Ring {op.replace('_', '-')}, step by step",
                    "Press play: the final frame holds the result on every rank.", viz.collective(op, world_size=4)))
    if bandwidth_rows:
        out.append(("bandwidth", "Bandwidth of each collective against message size",
                    "Bus bandwidth is algorithm bandwidth times the ring factor: what each link carries.",
                    viz.bandwidth(bandwidth_rows)))
    return out


def report_html(rows: list[TourRow], bandwidth_rows, quick: bool, seconds: float) -> str:
    """The whole report as one self-contained HTML page."""
    from ..viz.report import html_report, table_html

    ran = [r for r in rows if r.result is not None]
    bad = [r for r in rows if r.status in ("DIFFERS", "failed")]
    device = ", ".join(sorted({f"{r.result.device} ({r.result.backend})" for r in ran}))
    verdict = (f"All {len(ran)} layouts that ran match the single-device run." if not bad else
               f"{len(bad)} layout{'s' * (len(bad) > 1)} did not match: {', '.join(r.name for r in bad)}.")
    notes = "".join(f"<li><b>{html.escape(r.status)}: {html.escape(r.name)}</b>: {html.escape(r.note)}</li>"
                    for r in rows if r.note)
    settings = QUICK if quick else FULL
    intro = (f"<p>{html.escape(verdict)} Loss compared at every step, within {TOLERANCE:g} relative (fp32).</p>"
             f"<p class=\"note\">{datetime.datetime.now():%Y-%m-%d %H:%M}; torch {html.escape(torch.__version__)}; "
             f"ranks on {html.escape(device)}; {visible_gpus()} GPUs visible; "
             f"{'quick' if quick else 'full'} settings {html.escape(str(settings))}; {seconds:.0f} s.</p>"
             + table_html(TABLE_HEADER, table_rows(rows), bad_column=len(TABLE_HEADER) - 1,
                          bad_values=("DIFFERS", "failed"))
             + (f"<ul>{notes}</ul>" if notes else ""))
    return html_report("gpucourse tour", intro, figures(rows, bandwidth_rows))


def main(quick: bool = False, out: str | None = "gpucourse-tour.html", device: str = "auto", only=None,
         bandwidth=None) -> int:
    """Run the tour, print its table, write the report to ``out``; 0 if every layout that ran matches, else 1.

    ``only`` restricts the tour to some layouts (see :func:`run_tour`);
    ``bandwidth`` rows (``{op, bytes, algbw_GBps, busbw_GBps}``) are drawn
    instead of measuring a small sweep on 2 ranks.
    """
    start = time.perf_counter()
    rows = run_tour(quick=quick, only=only, device=device)
    print(format_table(rows), flush=True)
    if out:
        if bandwidth is None:
            sys.stderr.write("tour: measuring collective bandwidth on 2 ranks …\n")
            try:
                from .bandwidth import measure

                bandwidth = measure(2, sizes=BANDWIDTH_SIZES, quick=quick, device=device,
                                    timeout=RUN_TIMEOUT_S[False])["rows"]
            except (LaunchError, WorkerError, LaunchTimeout) as e:
                print(f"tour: bandwidth not measured, the report goes without it: {str(e).splitlines()[0]}")
        write_atomic(out, report_html(rows, bandwidth, quick, time.perf_counter() - start))
        print(f"report written to {out}", flush=True)
    count = {status: sum(r.status == status for r in rows) for status in ("ok", "DIFFERS", "failed", "skipped")}
    if count["DIFFERS"] or count["failed"]:
        print(f"tour: {count['DIFFERS']} layout{'s' * (count['DIFFERS'] != 1)} differ{'s' * (count['DIFFERS'] == 1)} "
              f"from the single-device run and {count['failed']} failed ({count['ok']} ok, "
              f"{count['skipped']} skipped).", flush=True)
        return 1
    print(f"tour: every layout that ran matches the single-device run ({count['ok']} ran, "
          f"{count['skipped']} skipped).", flush=True)
    return 0
