"""Profiling: `train --profile` writes a Chrome trace per rank and a summary whose shares add up;
MFU and scaling efficiency follow their stated formulas; the GPU table reads the user's file."""

from __future__ import annotations

import json
import os

import pytest

from gpucourse import cli, profiling
from gpucourse.modeled.gpus import GPUS, GPUSpec, get_gpu, gpus
from gpucourse.measure import RunResult
from gpucourse.model import MODELS, build_model

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_children")]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One dp=2 run through the CLI with --profile: (trace folder, result JSON path, printed text)."""
    folder = tmp_path_factory.mktemp("profile")
    result = folder / "run.json"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["train", "--dp", "2", "--steps", "4", "--seq-len", "32", "--quiet",
                         "--profile", str(folder / "traces"), "--peak-tflops", "0.1", "--json", str(result)])
    assert code == 0
    return folder / "traces", result, out.getvalue()


def test_every_rank_writes_a_chrome_trace(profiled):
    traces, _, _ = profiled
    for rank in (0, 1):
        with open(traces / f"rank{rank}.trace.json") as f:
            trace = json.load(f)
        assert trace["traceEvents"], f"rank {rank}'s trace has no events"
        assert trace["distributedInfo"]["rank"] == rank
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert any(n.startswith("ProfilerStep#") for n in names), "the traced steps are marked"


def test_summary_shares_add_up_and_are_printed(profiled):
    _, result, printed = profiled
    summary = profiling.summarize(str(result), peak_flops=1e11)
    assert set(summary["ranks"]) == {0, 1}
    for shares in summary["ranks"].values():
        parts = [shares["compute"], shares["comm"], shares["idle"]]
        assert all(0 <= p <= 1 for p in parts)
        assert sum(parts) == pytest.approx(1.0, abs=1e-9)
        assert shares["compute"] > 0 and shares["comm"] > 0  # data parallel computes and communicates
    assert "rank 0: compute" in printed and "rank 1: compute" in printed
    assert "MFU" in printed and "rank1.trace.json" in printed
    assert json.dumps(summary)  # plain data


def _result(tokens_per_s: float, world: int, timeline=(), model="tiny") -> RunResult:
    config = {"model": model, "batch_size": 8, "seq_len": 64, "dp": world, "tp": 1, "pp": 1}
    return RunResult(config=config, world_size=world, device="cpu", backend="gloo", losses=[1.0, 1.0],
                     step_times_s=[0.1, 0.1], tokens_per_s=tokens_per_s, timeline=list(timeline))


def test_mfu_is_six_n_tokens_over_the_peak_of_all_ranks():
    n = build_model(MODELS["tiny"], 0).num_params()
    assert profiling.count_params({"model": "tiny"}) == n
    summary = profiling.summarize(_result(10_000.0, world=2), peak_flops=1e12)
    assert summary["n_params"] == n
    assert summary["achieved_flops"] == 6 * n * 10_000.0
    assert summary["mfu"] == pytest.approx(6 * n * 10_000.0 / (2 * 1e12))


def test_without_a_peak_mfu_is_left_out_and_said_so():
    summary = profiling.summarize(_result(10_000.0, world=2))
    assert summary["mfu"] is None
    assert any("peak" in note for note in summary["notes"])
    assert not any(line.startswith("MFU") for line in profiling.format_summary(summary).splitlines())


def test_scaling_efficiency_is_per_rank_throughput_over_the_baseline():
    summary = profiling.summarize(_result(15_000.0, world=2), baseline=_result(10_000.0, world=1).to_dict())
    assert summary["scaling_efficiency"] == pytest.approx(0.75)
    assert summary["baseline_tokens_per_s_per_rank"] == 10_000.0


def span(kind, start, end, step=1, rank=0, **extra):
    return {"rank": rank, "step": step, "kind": kind, "name": kind, "microbatch": None,
            "start_s": start, "end_s": end, **extra}


def test_shares_of_a_known_timeline():
    # A step of 10 s: forward 0-3 with a blocking all-reduce 1-2 inside it, backward 3-6 with an async
    # bucket all-reduce 4-7 overlapping it, optimizer 8-9; idle 7-8 and 9-10.
    timeline = [span("step", 0, 10), span("forward", 0, 3), span("comm", 1, 2, blocking=True),
                span("backward", 3, 6), span("comm", 4, 7), span("optimizer", 8, 9)]
    shares = profiling.time_shares(timeline)[0]
    assert (shares["compute_s"], shares["comm_s"], shares["idle_s"]) == pytest.approx((6, 2, 2))
    assert shares["compute"] + shares["comm"] + shares["idle"] == pytest.approx(1)


def test_the_warm_up_step_is_left_out():
    timeline = [span("step", 0, 100, step=0), span("forward", 0, 100, step=0),
                span("step", 100, 110, step=1), span("comm", 100, 105, step=1)]
    summary = profiling.summarize(_result(1.0, world=1, timeline=timeline))
    assert summary["steps_analysed"] == [1]
    assert summary["ranks"][0]["comm"] == pytest.approx(0.5)


def test_trace_schedule_fits_short_runs():
    assert profiling._schedule(None) == (1, 1, 3)
    for steps in range(1, 8):
        wait, warmup, active = profiling._schedule(steps)
        assert active >= 1 and wait + warmup + active <= steps


def test_trace_without_a_folder_is_a_no_op():
    with profiling.trace(None, 0, 3) as prof:
        profiling.step()
    assert prof is None


def test_gpu_table_and_user_file(tmp_path, monkeypatch):
    assert {"h100", "a100", "h200", "l4", "cpu"} <= set(GPUS)
    h100 = get_gpu("H100")
    assert isinstance(h100, GPUSpec) and h100.peak_flops("bf16") > h100.peak_flops("fp32") > 0
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"b200": {"peak_bf16_flops": 2.25e15, "peak_fp32_flops": 8e13, "memory_gb": 192,
                                         "intra_node_GBps": 900, "inter_node_GBps": 50},
                                "h100": {"memory_gb": 94}}))
    assert get_gpu("b200", path).memory_gb == 192
    monkeypatch.setenv("GPUCOURSE_GPUS", str(path))
    assert gpus()["h100"].memory_gb == 94 and gpus()["h100"].peak_bf16_flops == h100.peak_bf16_flops
    assert GPUS["h100"].memory_gb == 80  # the built-in table is left alone
    with pytest.raises(KeyError, match="known: h100"):
        get_gpu("nope")
    path.write_text(json.dumps({"x1": {"memory_gb": 1}}))
    with pytest.raises(ValueError, match="needs"):
        get_gpu("x1")
    path.write_text(json.dumps({"h100": {"memroy_gb": 1}}))
    with pytest.raises(ValueError, match="unknown field memroy_gb"):
        get_gpu("h100")


def test_profile_flags_are_checked_before_anything_runs(tmp_path, capsys):
    assert cli.main(["train", "--gpu", "nope"]) == 2
    assert "--gpu 'nope' is not in the GPU table; known: h100" in capsys.readouterr().err
    assert cli.main(["train", "--peak-tflops", "-1"]) == 2
    (tmp_path / "file").write_text("x")
    assert cli.main(["train", "--profile", str(tmp_path / "file")]) == 2
    assert cli.main(["train", "--baseline", str(tmp_path / "file")]) == 2
    assert "file is not a run saved with 'gpucourse train --json FILE': it is not JSON" in capsys.readouterr().err


def test_the_profilers_own_start_and_stop_lines_are_hidden(tmp_path, capfd):
    """Kineto writes "USDT: ... profiler_start" to the process's stderr: in a notebook, a red block that is no error."""
    import torch

    steps = profiling.WAIT + profiling.WARMUP + profiling.ACTIVE  # a full schedule: no warning about its warm-up
    with profiling.trace(tmp_path, 0, steps=steps):
        for _ in range(steps):
            torch.ones(4).sum()
            profiling.step()
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "USDT" not in err
    assert json.loads((tmp_path / "rank0.trace.json").read_text())["traceEvents"]


def test_spans_are_nvtx_ranges_on_cuda(monkeypatch):
    """On CUDA every recorded span is pushed and popped as an NVTX range named as the timeline names it, nested
    as the spans are; on the CPU nothing touches NVTX. (CUDA's events and NVTX are replaced by recording fakes.)"""
    import torch

    from gpucourse.measure import Recorder, nvtx_label

    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            calls.append("event")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append("pop"))
    rec = Recorder(0, torch.device("cuda", 0))
    calls.clear()
    with rec.span("step"):
        with rec.span("forward", microbatch=2):
            pass
        with rec.span("comm", "all_reduce", op="all_reduce", bytes=4):
            pass
    assert [c for c in calls if c != "event"] == [("push", "step"), ("push", "forward mb2"), "pop",
                                                    ("push", "comm all_reduce"), "pop", "pop"]
    assert [nvtx_label(s) for s in rec.spans] == ["forward mb2", "comm all_reduce", "step"]
    # An asynchronous collective's range runs from its launch to its completion, across threads.
    monkeypatch.setattr(torch.cuda.nvtx, "range_start", lambda name: calls.append(("start", name)) or 7)
    monkeypatch.setattr(torch.cuda.nvtx, "range_end", lambda handle: calls.append(("end", handle)))
    calls.clear()
    handle = rec.open_range("comm", "all_reduce bucket 0")
    rec.add_span("comm", "all_reduce bucket 0", rec.mark(), rec.mark(), nvtx=handle)
    assert [c for c in calls if c != "event"] == [("start", "comm all_reduce bucket 0"), ("end", 7)]
    calls.clear()
    cpu = Recorder(0, torch.device("cpu"))
    with cpu.span("forward"):
        pass
    assert cpu.open_range("comm", "x") is None and calls == []


def test_memory_snapshot_records_until_the_end_even_an_oom(tmp_path, monkeypatch):
    """The snapshot is switched on before the body, written whole (never half a file) when it ends — also when it
    ends in an error, as an out-of-memory one — and switched off after. (PyTorch's recorder is replaced by a fake:
    there is no CUDA allocator here.)"""
    import torch

    calls = []

    def record(enabled="all", max_entries=None, **kw):
        calls.append(("record", enabled, max_entries))

    def dump(path):
        calls.append(("dump", os.path.basename(path)))
        with open(path, "wb") as f:
            f.write(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    with pytest.raises(RuntimeError, match="out of memory"):
        with profiling.memory_snapshot(tmp_path / "snaps", 3, max_entries=10):
            calls.append("body")
            raise RuntimeError("CUDA out of memory")
    assert calls == [("record", "all", 10), "body", ("dump", "rank3.memory.pickle.part"), ("record", None, None)]
    assert sorted(os.listdir(tmp_path / "snaps")) == ["rank3.memory.pickle"]
    calls.clear()
    with profiling.memory_snapshot(None, 0):
        pass
    assert calls == []


def test_a_memory_snapshot_on_cpu_ranks_is_refused_in_one_sentence(tmp_path, capsys):
    from gpucourse import TrainConfig, run
    from gpucourse.config import ConfigError

    assert cli.main(["train", "--device", "cpu", "--memory-snapshot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "records the CUDA allocator and these ranks run on the CPU" in err and err.count("\n") == 1
    (tmp_path / "file").write_text("x")
    assert cli.main(["train", "--memory-snapshot", str(tmp_path / "file")]) == 2
    with pytest.raises(ConfigError, match="CUDA allocator"):
        run(TrainConfig(device="cpu", memory_snapshot=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_peak_memory_is_the_most_bytes_alive_at_once():
    """Counted from the tensors a step makes and frees, a storage resized to nothing (as FSDP frees a gathered
    weight) included, on top of what was held before the step."""
    import torch

    held = torch.zeros(100)

    def step():
        a = torch.empty(1000)
        b = torch.empty(2000)  # the most: 12,000 bytes made by the step
        del a, b
        c = torch.empty(2500)
        c.untyped_storage().resize_(0)  # freed, though the tensor lives on
        d = torch.empty(2900)  # 11,600 bytes: with c still counted the peak would be 21,600
        return c, d

    assert profiling.peak_memory(step, held) == {"total": 12_400, "activations": 12_000, "inputs": 400}
