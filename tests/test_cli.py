"""The gpucourse command: bad input is refused in one line (status 2) before any
rank starts; a good run writes the result and weights it says it writes; a
failed run leaves no half-written file."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gpucourse.train
from gpucourse import cli
from gpucourse.config import TrainConfig
from gpucourse.model import build_model
from gpucourse.runtime.launcher import cpu_rank_limit
from procs import clean_env

pytestmark = pytest.mark.timeout(120)

TOO_MANY = str(2 * cpu_rank_limit())
# name: (arguments after `train`, {} stands for the test's folder; words the error must contain)
BAD_INPUT = {
    "dp 0": (["--dp", "0"], "--dp 0 must be at least 1."),
    "unknown impl": (["--impl", "bogus"], "--impl 'bogus' is not one of scratch, torch, accelerate."),
    "batch not divisible": (["--batch-size", "8", "--grad-accum", "3"], "divisible"),
    "too many cpu ranks": (["--dp", TOO_MANY, "--batch-size", TOO_MANY],
                           "more than this machine can run as CPU processes"),
    "cuda without gpus": (["--device", "cuda"], "device='auto' to fall back"),
    "json into a missing folder": (["--json", "{}/missing/r.json"], "does not exist"),
    "json is a folder": (["--json", "{}"], "is a folder"),
    "weights into a missing folder": (["--export-weights", "{}/missing/w.pt"], "does not exist"),
    "unknown model": (["--model", "nope"], "--model 'nope' is not one of tiny,"),
}


def bad_argv(case: str, folder) -> tuple[list[str], str]:
    args, words = BAD_INPUT[case]
    args = [a.replace("{}", str(folder)) for a in args]
    if "--json" not in args:
        args += ["--json", str(folder / "r.json")]  # a path that must stay unwritten
    return ["train", "--steps", "3", *args], words


def gpucourse_cmd(*args: str, cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    # No GPU may be visible, whatever the machine: these tests are about CPU ranks.
    return subprocess.run([sys.executable, "-m", "gpucourse", *args], cwd=cwd, env=clean_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_refused_in_one_line_before_any_rank_starts(case, tmp_path, capsys, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(gpucourse.train, "run", no_run)
    argv, words = bad_argv(case, tmp_path)
    start = time.monotonic()
    assert cli.main(argv) == 2
    assert time.monotonic() - start < 5
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith("gpucourse: error: ") and words in line, line
    assert out == ""
    assert list(tmp_path.iterdir()) == [], "a file was written"


def test_bad_input_from_the_command_line(tmp_path):
    # Real commands, at once: status 2 and nothing else on stderr (no warnings). Each
    # costs a torch import (about 2 s of CPU), so only two of the cases run this way:
    # one refused by the config, one by the launcher's device plan.
    cases = ("unknown impl", "too many cpu ranks")
    folders = {case: tmp_path / f"case{i}" for i, case in enumerate(cases)}
    procs = {}
    for case, folder in folders.items():
        folder.mkdir()
        argv, _ = bad_argv(case, folder)
        procs[case] = subprocess.Popen([sys.executable, "-m", "gpucourse", *argv], cwd=folder,
                                       env=clean_env(CUDA_VISIBLE_DEVICES=""), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True)
    try:
        outputs = {case: p.communicate(timeout=90) for case, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for case, (out, err) in outputs.items():
        words = BAD_INPUT[case][1]
        assert procs[case].returncode == 2, (case, err)
        assert len(err.splitlines()) == 1 and err.startswith("gpucourse: error: ") and words in err, (case, err)
        assert out == "", (case, out)
        assert list(folders[case].iterdir()) == [], case


def test_train_writes_the_result_and_the_weights(tmp_path):
    proc = gpucourse_cmd("train", "--dp", "2", "--steps", "5", "--json", "r.json", "--export-weights", "w.pt",
                         cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "w.pt"], "a temporary file was left behind"

    result = json.loads((tmp_path / "r.json").read_text())
    assert {"config", "world_size", "device", "backend", "losses", "step_times_s", "tokens_per_s", "timeline",
            "comm_bytes"} <= set(result)
    assert (result["world_size"], result["device"], result["backend"]) == (2, "cpu", "gloo")
    assert result["config"]["dp"] == 2 and result["config"]["steps"] == 5
    assert len(result["losses"]) == 5 and all(isinstance(x, float) for x in result["losses"])
    assert len(result["step_times_s"]) == 5 and result["tokens_per_s"] > 0
    spans = result["timeline"]
    assert spans and {s["rank"] for s in spans} == {0, 1}
    for span in spans:
        assert {"rank", "kind", "name", "start_s", "end_s", "microbatch"} <= set(span)
        assert span["end_s"] >= span["start_s"]
    comm = result["comm_bytes"]
    assert comm["per_op"].get("all_reduce", 0) > 0
    assert comm["total"] == sum(comm["per_op"].values())

    state = torch.load(tmp_path / "w.pt", weights_only=True)
    expected = build_model(TrainConfig.from_dict(result["config"]).model_config(), seed=0).state_dict()
    assert list(state) == list(expected)
    assert all(state[k].shape == expected[k].shape for k in expected)
    assert "result written to r.json" in proc.stdout


def test_a_failed_run_leaves_no_result_file(tmp_path):
    # A run far too long for its --timeout: stopped, one line saying so (then what each rank was in), nothing written.
    proc = gpucourse_cmd("train", "--dp", "2", "--steps", "100000", "--timeout", "1", "--json", "r.json",
                         "--export-weights", "w.pt", cwd=tmp_path, timeout=60)
    assert proc.returncode == 124
    line, *diagnosis = [line for line in proc.stderr.splitlines() if line.startswith("gpucourse:")]
    assert line.startswith("gpucourse: timeout: ") and "did not finish within 1 s" in line, proc.stderr
    assert all(d.startswith("gpucourse: diagnosis: ") for d in diagnosis), proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_train_list_shows_data_parallel_in_both_impls(capsys):
    assert cli.main(["train", "--list"]) == 0
    rows = {tuple(line.split()[:2]) for line in capsys.readouterr().out.splitlines()}
    assert {("dp", "scratch"), ("dp", "torch")} <= rows


def test_doctor_json_parses(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch_version"] == torch.__version__


def test_lab_refuses_a_bad_port_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("os.execv", lambda *a: (_ for _ in ()).throw(AssertionError("the server was started")))
    assert cli.main(["lab", "--port", "70000"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == "gpucourse: error: --port 70000 must be at most 65535 (a port number; 0 picks a free one).", line


def test_lab_serves_the_notebooks_on_localhost_behind_a_token(monkeypatch, capsys):
    """What make lab runs: this interpreter's JupyterLab on notebooks/, 127.0.0.1 only, no token switched off."""
    from gpucourse.course import lab

    started, defaults = [], []
    monkeypatch.setattr("os.execv", lambda path, argv: started.append(argv))
    monkeypatch.setattr(lab, "install_course_defaults", lambda: defaults.append(True))
    cli.main(["lab", "--port", "0"])
    [argv] = started
    assert defaults == [True]  # the news pop-up turned off first
    assert argv[:3] == [sys.executable, "-m", "jupyterlab"]
    assert f"--ServerApp.root_dir={lab.NOTEBOOKS}" in argv and "--ServerApp.ip=127.0.0.1" in argv
    assert "--ServerApp.port=0" in argv
    assert not any("token=" in a.lower() and a.rstrip().endswith("=") for a in argv), argv
    # Its kernels are reached over Unix sockets: two servers started at once can never be handed one TCP port.
    assert "--KernelManager.transport=ipc" in argv


def test_lab_moves_its_kernels_sockets_out_of_a_runtime_folder_too_deep_for_them(monkeypatch, tmp_path, short_tmp):
    from gpucourse.course import lab

    monkeypatch.setattr("os.execv", lambda path, argv: None)
    monkeypatch.setattr(lab, "install_course_defaults", lambda: None)
    for runtime, moved in ((Path("/tmp/jupyter-runtime"), False), (tmp_path / ("deep" * 20), True)):
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
        cli.main(["lab", "--port", "0"])
        expected = short_tmp / f"gpucourse-{os.getuid()}" / "lab" if moved else runtime
        assert os.environ["JUPYTER_RUNTIME_DIR"] == str(expected)


def test_each_supported_rows_command_describes_that_rows_config():
    from gpucourse.parallel.catalogue import supported, supported_table

    parser = cli.build_parser()
    for (layout, impl, _, changes), row in zip(supported(), supported_table()):
        args = parser.parse_args(shlex.split(row["example"])[1:])
        assert cli.config_from(args) == TrainConfig(**changes), (layout, impl, row["example"])


def test_the_course_defaults_turn_off_jupyterlabs_news_and_keep_a_learners_own_choice(tmp_path):
    from gpucourse.course import lab

    path = lab.install_course_defaults(tmp_path)
    plugin = "@jupyterlab/apputils-extension:notification"
    assert json.loads(path.read_text())[plugin] == {"fetchNews": "false", "checkForUpdates": False}
    path.write_text(json.dumps({plugin: {"fetchNews": "true"}, "other:plugin": {"x": 1}}))
    lab.install_course_defaults(tmp_path)
    assert json.loads(path.read_text()) == {plugin: {"fetchNews": "true", "checkForUpdates": False},
                                            "other:plugin": {"x": 1}}


def test_a_wrong_flag_gets_one_sentence_and_a_schedule_needs_a_pipeline(capsys):
    assert cli.main(["train", "--dp", "two"]) == 2
    assert cli.main(["train", "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and not any("usage:" in line for line in err)
    assert err[0] == "gpucourse: error: --dp two must be a whole number from 1 to 1048576."
    assert "give --pp 2 or more" in err[1]


def test_checkpoint_activations_takes_selective_or_full_and_alone_means_full(capsys):
    parser = cli.build_parser()
    for argv, recompute in (([], "none"), (["--checkpoint-activations"], "full"),
                            (["--checkpoint-activations", "selective", "--attention", "math"], "selective")):
        cfg = cli.config_from(parser.parse_args(["train", *argv]))
        assert cfg.recompute == recompute and cfg.checkpoint_activations == {"none": False, "full": True}.get(
            recompute, recompute)
    assert cli.config_from(parser.parse_args(["train", "--attention", "math"])).attention == "math"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--checkpoint-activations", "some"])
    assert "--checkpoint-activations 'some' is not one of none, selective, full" in capsys.readouterr().err


def parsers(parser=None, name="gpucourse"):
    """Every parser of the gpucourse command, subcommands' and theirs included: (command line, parser)."""
    import argparse

    parser = parser or cli.build_parser()
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


def test_no_flag_is_taken_for_the_start_of_a_longer_one(capsys):
    """argparse's default reads --tp 3 as --tpot-ms 3 in a command without --tp: every parser refuses
    abbreviations, and a flag it does not know is answered with the flags perhaps meant."""
    found = dict(parsers())
    assert len(found) > 20 and all(p.allow_abbrev is False for p in found.values())
    for argv, words in ((["serve-bench", "--tp", "3"], "--tp is not a flag of gpucourse serve-bench; the nearest: "
                                                        "--tpot-ms"),
                        (["plan", "--gpus", "8", "--gpus-per", "4"], "the nearest: --gpus-per-node"),
                        (["serve-bench", "--blok", "3"], "the nearest: --blocks"),
                        (["workshop", "start", "--seat=3"], "--seat is not a flag of gpucourse workshop start; the "
                                                            "nearest: --seats"),
                        (["doctor", "now"], "gpucourse doctor does not take 'now'"),
                        (["serve-bech"], "'serve-bech' is not one of train, submit")):
        with pytest.raises(SystemExit) as exited:
            cli.main(argv)
        [line] = capsys.readouterr().err.splitlines()
        assert exited.value.code == 2 and words in line and line.endswith("--help')."), line


def test_every_config_field_has_its_flag_derived_from_its_tag(monkeypatch):
    """A field's flag comes from its tag and help in config.py: adding a field adds its flag, and no flag is
    written twice by hand."""
    import dataclasses

    from gpucourse.cli import common
    from gpucourse.config import layout

    parser = cli.build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    dests = {a.dest for a in train._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} - dests == {"overrides"}
    assert cli.config_from(parser.parse_args(["train"])) == TrainConfig()
    assert cli.config_from(parser.parse_args(["train", "--no-record", "--dropout", "0.1"])) == TrainConfig(
        record=False, dropout=0.1)
    plan = parser._subparsers._group_actions[0].choices["memory"]
    assert not {"save", "resume", "profile"} & {a.dest for a in plan._actions}  # train's alone

    @dataclasses.dataclass
    class Wider(TrainConfig):
        new_knob: int = layout(3, "a knob added in one place")

    monkeypatch.setattr(common, "TrainConfig", Wider)
    args = cli.build_parser().parse_args(["train", "--new-knob", "5"])
    assert common.config_from(args).new_knob == 5


def test_every_commands_help_states_each_flags_default(capsys):
    """--help says every flag's default: a parser of every command, nested ones too, formats each flag that has a
    default with it, in its own words or as "(default: X)"."""
    import argparse

    def walk(parser, path=()):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, (*path, name))

    switches = (argparse._StoreConstAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
                argparse._HelpAction)
    missing = []
    for path, parser in walk(cli.build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (action.option_strings and action.default not in (argparse.SUPPRESS, None, False, [], ())
                    and not isinstance(action, switches)
                    and "default" not in formatter._expand_help(action).lower()):
                missing.append(f"{' '.join(path)} {action.option_strings[0]}")
    assert not missing, missing
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--model MODEL model size: tiny, tiny-long, small, medium, gpt2-small, gpt2-medium (default: tiny)" in text
