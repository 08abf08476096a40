"""Checkpoints: a run saved at step 10 and resumed to 20 is the run that never stopped.

For every layout: the losses of steps 10..19 and the final weights of the
resumed run equal those of an uninterrupted 20-step run (1e-6). Resumed at
*another* layout, they equal it as every layout equals one device (1e-5). A
save that crashed half-way is ignored, a changed model or setting is refused
before any rank starts, and a job whose rank dies is restarted by torchrun from
its last checkpoint and ends where the uninterrupted run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess

import pytest
import torch

from gpucourse import TrainConfig, cli, run
from gpucourse.checkpoint import LATEST, complete_checkpoints, read_meta
from gpucourse.config import ConfigError
from gpucourse.measure import RunResult
from gpucourse.runtime import WorkerError
from procs import BIN, clean_env

BASE = dict(batch_size=8, seq_len=32)
pytestmark = pytest.mark.timeout(300)

LAYOUTS = {
    "single": {},
    "single-dropout": dict(dropout=0.1),  # dropout draws from the random state: it must be restored too
    "dp2": dict(dp=2),
    "dp2-zero2": dict(dp=2, zero=2),
    "pp2-1f1b": dict(pp=2, schedule="1f1b", microbatches=4),
    "tp2": dict(tp=2),
    "dp2-ddp": dict(dp=2, impl="torch"),
    "dp2-fsdp2": dict(dp=2, zero=3, impl="torch"),
    "dp2-zero3": dict(dp=2, zero=3),
    "dp2×tp2-zero1": dict(dp=2, tp=2, zero=1),
    "tp2×pp2-torch": dict(tp=2, pp=2, microbatches=2, impl="torch"),
}


def _run(tmp_path, name, **kw):
    path = tmp_path / f"{name}.pt"
    result = run(TrainConfig(**BASE, **kw), timeout=180, export_weights=path, quiet=True)
    return result, torch.load(path)


def assert_continues(resumed, weights, full, full_weights, start: int, tol: float = 1e-6):
    """``resumed`` covers steps ``start``.. of ``full`` with the same losses, and ends with the same weights (within
    ``tol``: float rounding of the same layout; another layout's sums add in another order, see test_equality)."""
    assert resumed.start_step == start
    assert len(resumed.losses) == len(full.losses) - start
    for i, (a, b) in enumerate(zip(resumed.losses, full.losses[start:])):
        assert abs(a - b) <= tol * abs(b), f"step {start + i}: loss {a} after resuming vs {b} uninterrupted"
    assert sorted(weights) == sorted(full_weights)
    for name, w in full_weights.items():
        diff = (weights[name] - w).abs().max().item()
        assert diff <= tol, f"{name}: weights differ by {diff}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_at_10_then_resume_to_20_equals_20_steps(tmp_path, tmp_path_factory, layout):
    kw = LAYOUTS[layout]
    folder = tmp_path / "ckpt"
    full, full_weights = one_device(tmp_path_factory) if not kw else _run(tmp_path, "full", steps=20, **kw)
    first, _ = _run(tmp_path, "first", steps=10, save=str(folder), **kw)
    assert first.losses == pytest.approx(full.losses[:10], rel=1e-6), "saving changed the training"
    assert sorted(os.listdir(folder)) == [LATEST, "step-000010"], "a save left a temporary folder behind"
    assert (folder / LATEST).read_text() == "step-000010\n"
    resumed, weights = _run(tmp_path, "resumed", steps=20, resume=str(folder), **kw)
    assert_continues(resumed, weights, full, full_weights, start=10)


# Saved at one layout, resumed at another: DCP reshards. (The two examples, and scratch → PyTorch.)
MOVES = {
    "dp2-zero2→tp2×pp2": (dict(dp=2, zero=2), dict(tp=2, pp=2, microbatches=2)),
    "dp4→dp2": (dict(dp=4), dict(dp=2)),
    "dp2-zero3-scratch→dp2×tp2-fsdp2": (dict(dp=2, zero=3), dict(dp=2, tp=2, zero=3, impl="torch")),
}


_ONE_DEVICE: dict = {}


def one_device(tmp_path_factory):
    """The uninterrupted single-device run of 20 steps (trained once per session)."""
    if not _ONE_DEVICE:
        _ONE_DEVICE["run"] = _run(tmp_path_factory.mktemp("single"), "full", steps=20)
    return _ONE_DEVICE["run"]


@pytest.mark.parametrize("move", MOVES)
def test_resume_at_another_layout_equals_the_uninterrupted_run(tmp_path, tmp_path_factory, move):
    before, after = MOVES[move]
    folder = tmp_path / "ckpt"
    full, full_weights = one_device(tmp_path_factory)  # what every layout equals
    _run(tmp_path, "first", steps=10, save=str(folder), **before)
    resumed, weights = _run(tmp_path, "resumed", steps=20, resume=str(folder), **after)
    assert resumed.start_step == 10 and resumed.world_size == TrainConfig(**after).world_size
    for i, (a, b) in enumerate(zip(resumed.losses, full.losses[10:])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {10 + i}: loss {a} after moving vs {b} uninterrupted"
    for name, w in full_weights.items():
        assert (weights[name] - w).abs().max().item() <= 5e-5, name


def test_resume_with_other_chunks_a_rank_a_straggler_or_a_snapshot_folder(tmp_path, monkeypatch):
    """virtual_stages is part of the layout (the interleaved schedule's chunks a rank), a straggler and a memory
    snapshot belong to the run: none of them refuses a resume, and a resume at other chunks continues the run."""
    from gpucourse.checkpoint import find_resume

    eight = dict(overrides={"n_layer": 8}, pp=2, microbatches=2, schedule="interleaved-1f1b")
    full, full_weights = _run(tmp_path, "full", steps=12, virtual_stages=2, **eight)
    folder = tmp_path / "ckpt"
    _run(tmp_path, "first", steps=6, save=str(folder), virtual_stages=2, **eight)
    for other in (dict(virtual_stages=4), dict(straggler="1:5"), dict(memory_snapshot=str(tmp_path / "snap"))):
        assert find_resume(TrainConfig(**BASE, steps=12, resume=str(folder), **{**eight, "virtual_stages": 2,
                                                                                 **other}))
    resumed, weights = _run(tmp_path, "resumed", steps=12, resume=str(folder), virtual_stages=4, **eight)
    assert resumed.start_step == 6
    for i, (a, b) in enumerate(zip(resumed.losses, full.losses[6:])):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {6 + i}: loss {a} at 4 chunks a rank vs {b} at 2"
    for name, w in full_weights.items():
        assert (weights[name] - w).abs().max().item() <= 5e-5, name


def _tensor_shapes(path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def test_sharded_state_is_stored_under_whole_names_each_rank_writing_its_piece(tmp_path):
    # tensor parallel: every weight under its single-device name and shape, though no rank holds it whole
    run(TrainConfig(**BASE, tp=2, steps=2, save=str(tmp_path / "tp")), timeout=120, quiet=True)
    shapes = _tensor_shapes(tmp_path / "tp" / "step-000002")
    assert shapes["model.blocks.0.attn.q.weight"] == (64, 64)
    assert shapes["optim.blocks.0.mlp.proj.weight.exp_avg"] == (64, 256)
    # ZeRO: the flat shards' moments are stored per parameter, whole, as one device's would be
    run(TrainConfig(**BASE, dp=2, zero=1, steps=2, save=str(tmp_path / "zero")), timeout=120, quiet=True)
    path = tmp_path / "zero" / "step-000002"
    zero_shapes = _tensor_shapes(path)
    assert {k: v for k, v in zero_shapes.items() if not k.startswith("rng.")} == \
        {k: v for k, v in shapes.items() if not k.startswith("rng.")}, "ZeRO and tensor parallel save the same"
    assert read_meta(path)["step"] == 2 and read_meta(path)["config"]["zero"] == 1


def test_a_save_that_crashed_half_way_is_ignored(tmp_path):
    folder = tmp_path / "ckpt"
    full, full_weights = _run(tmp_path, "full", steps=12)
    _run(tmp_path, "first", steps=8, save=str(folder), save_every=4)
    assert [step for step, _ in complete_checkpoints(folder)] == [4, 8]
    # What a crash during the save of step 8 leaves: a .tmp folder, without our meta.json
    # (written last, before the rename), and the pointer still at step 4.
    os.rename(folder / "step-000008", folder / "step-000008.tmp")
    os.remove(folder / "step-000008.tmp" / "meta.json")
    (folder / LATEST).write_text("step-000004\n")
    resumed, weights = _run(tmp_path, "resumed", steps=12, save=str(folder), resume=str(folder), save_every=4)
    assert_continues(resumed, weights, full, full_weights, start=4)
    assert [step for step, _ in complete_checkpoints(folder)] == [4, 8, 12]
    assert not (folder / "step-000008.tmp").exists(), "the stale half-written save was cleared"


def test_resume_from_a_folder_without_a_complete_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "step-000010.tmp").mkdir(parents=True)  # only an unfinished save
    with pytest.raises(ConfigError, match="holds no complete checkpoint"):
        run(TrainConfig(**BASE, steps=3, resume=str(folder)), timeout=60, quiet=True)
    # ...unless it is also where the run saves: a job's first attempt starts from step 0.
    result = run(TrainConfig(**BASE, steps=3, resume=str(folder), save=str(folder)), timeout=60, quiet=True)
    assert result.start_step == 0 and len(result.losses) == 3
    assert [step for step, _ in complete_checkpoints(folder)] == [3]


def test_resuming_another_model_or_setting_is_refused_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "ckpt"
    run(TrainConfig(**BASE, dp=2, steps=2, save=str(folder)), timeout=60, quiet=True)

    def no_launch(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr("gpucourse.train.launch", no_launch)
    with pytest.raises(ConfigError, match=r"seq_len=32 but this run has seq_len=64.*the layout .* may change"):
        run(TrainConfig(batch_size=8, seq_len=64, dp=2, steps=4, resume=str(folder)), timeout=60, quiet=True)
    with pytest.raises(ConfigError, match=r"model='tiny' but this run has model='small'"):
        run(TrainConfig(**BASE, model="small", dp=2, steps=4, resume=str(folder)), timeout=60, quiet=True)
    with pytest.raises(ConfigError, match="nothing to train"):
        run(TrainConfig(**BASE, dp=2, steps=2, resume=str(folder)), timeout=60, quiet=True)
    # The command line says the same in one line, exit status 2.
    code = cli.main(["train", "--dp", "2", "--lr", "0.01", "--steps", "4", "--batch-size", "8", "--seq-len", "32",
                     "--resume", str(folder)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "lr=0.003 but this run has lr=0.01" in err, err
    meta = folder / "step-000002" / "meta.json"  # a checkpoint of the earlier, layout-bound format
    meta.write_text(json.dumps({k: v for k, v in json.loads(meta.read_text()).items() if k != "format"}))
    with pytest.raises(ConfigError, match="saved by an earlier gpucourse"):
        run(TrainConfig(**BASE, dp=2, steps=4, resume=str(folder)), timeout=60, quiet=True)


@pytest.mark.parametrize("args, words", [
    (["--save-every", "2"], "no save folder is set"),
    (["--save", "{}/a-file"], "is a file"),
    (["--save", "{}/ckpt", "--save-every", "-1"], "--save-every -1 must be at least 0"),
    (["--resume", "{}/nothing-here"], "holds no complete checkpoint"),
], ids=["every without save", "save into a file", "negative every", "resume from nothing"])
def test_bad_checkpoint_options_are_refused_in_one_line(tmp_path, capsys, monkeypatch, args, words):
    monkeypatch.setattr("gpucourse.train.launch", lambda *a, **k: pytest.fail("ranks were started"))
    (tmp_path / "a-file").touch()
    code = cli.main(["train", "--steps", "2", *(a.replace("{}", str(tmp_path)) for a in args)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err, err


def test_the_fault_hook_ends_one_rank_like_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUCOURSE_FAULT", "rank=1,step=2")
    with pytest.raises(WorkerError) as err:
        run(TrainConfig(**BASE, dp=2, steps=4), timeout=60, quiet=True)
    # The launcher names the rank that died without raising (it may not learn the exit code first).
    assert (err.value.rank, err.value.exc_type) == (1, "ProcessExit")


def test_torchrun_restarts_a_failed_job_from_its_last_checkpoint(tmp_path):
    folder, out, weights = tmp_path / "ckpt", tmp_path / "out.json", tmp_path / "w.pt"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "gpucourse", "train", "--dp", "2", "--steps", "12", "--seq-len", "32", "--batch-size", "8",
           "--save", str(folder), "--save-every", "4", "--resume", str(folder),
           "--json", str(out), "--export-weights", str(weights), "--quiet"]
    # torchrun's agent shares its store with the ranks; a restarted attempt can then read the
    # addresses the dead attempt left there and fail to connect (pytorch/pytorch#135712).
    # Opting out gives every attempt a fresh store.
    env = clean_env(GPUCOURSE_FAULT="rank=1,step=6", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    # A session of its own, so that whatever happens no rank outlives the test.
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        full, full_weights = _run(tmp_path, "full", dp=2, steps=12)  # while torchrun starts
        stdout, stderr = proc.communicate(timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    assert "rank 1 ends its process at step 6" in stderr
    assert "resumed from" in stdout and "step-000004 at step 4" in stdout
    result = json.loads(out.read_text())
    assert result["start_step"] == 4, "the restarted attempt goes on from the step-4 checkpoint"
    assert_continues(RunResult.from_dict(result), torch.load(weights), full, full_weights, start=4)
    assert [step for step, _ in complete_checkpoints(folder)] == [4, 8, 12]
    assert (folder / LATEST).read_text() == "step-000012\n"


def test_what_a_resume_may_change_is_read_from_the_configs_tags():
    """Every config field has one kind; a checkpoint lets a resume change the layout and run fields, nothing else."""
    import dataclasses

    from gpucourse import checkpoint
    from gpucourse.config import fields_of

    kinds = {kind: set(fields_of(kind)) for kind in ("layout", "run", "training")}
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    assert sorted(n for names_ in kinds.values() for n in names_) == sorted(names)
    assert (set(checkpoint.LAYOUT_OPTIONS), set(checkpoint.RUN_OPTIONS)) == (kinds["layout"], kinds["run"])
    assert {"virtual_stages", "attention", "checkpoint_activations"} <= kinds["layout"]
    assert {"straggler", "memory_snapshot", "steps"} <= kinds["run"] and {"lr", "seed", "model"} <= kinds["training"]
    saved = TrainConfig(pp=2, microbatches=2).to_dict()
    moved = TrainConfig(pp=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2, steps=40,
                        straggler="1:5", checkpoint_activations="selective", attention="math")
    assert checkpoint._differences(saved, moved) == []
    assert checkpoint._differences(saved, TrainConfig(pp=2, microbatches=2, lr=1e-2, seed=3)) == ["lr", "seed"]
