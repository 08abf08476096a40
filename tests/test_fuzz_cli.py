"""A fuzzer for every command's flags: whatever a learner types, the answer is a result or one sentence.

The commands are read from the real ``gpucourse`` parser (its subcommands, their subcommands, every flag, its
kind of value, choices and number of values), so a flag added tomorrow is fuzzed without anyone writing a case.
For each command hypothesis draws argument vectors — each flag's good values beside the edges (0, -1, NaN, ±inf,
huge, empty, text where a number goes, unknown names; files that are missing, folders, empty, not JSON, JSON of
the wrong shape, with NaN fields), one or several bad at once, a flag cut short, misspelt or without its value —
and runs ``gpucourse.cli.main`` in this process. Each run must end within ``CASE_S`` seconds either with status 0
and output without a NaN or an infinity in it, or with another status and exactly one sentence on stderr: never
a traceback, never a hang.

Commands that start ranks, servers or jobs (train, submit, bench, tour, bandwidth, troubleshoot, lab, grade,
quiz, workshop) are parsed and checked as usual, and stopped where they would start: what they start is
replaced by a stand-in that says so. The functions notebooks call with a learner's values (the planners, the
memory estimates, a trace's requests) are fuzzed the same way: a result, or ConfigError/ValueError in one sentence.

The suite runs a few examples a command, seeded (derandomized), in well under a minute on two cores;
``scripts/fuzz-cli`` runs many more, on a seed of its choosing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import re
import signal
import sys
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st

from gpucourse import cli
from gpucourse.readable import ConfigError
from gpucourse.values import Kind, Name, ReadableFile
from test_bad_input import one_rank_run

pytestmark = pytest.mark.timeout(600, method="thread")  # each run's own limit is a SIGALRM (run_main)

SCALE = float(os.environ.get("GPUCOURSE_FUZZ_SCALE", "1"))  # scripts/fuzz-cli: many times the examples
SEED = os.environ.get("GPUCOURSE_FUZZ_SEED")                # scripts/fuzz-cli: a seed of its own, else derandomized
CASE_S = float(os.environ.get("GPUCOURSE_FUZZ_CASE_S", "20"))  # a run longer than this is a hang
SHOW = os.environ.get("GPUCOURSE_FUZZ_SHOW")  # set: each run's status and argument vector, as it ends (pytest -s)

# Examples per command in the suite (scripts/fuzz-cli multiplies them): the commands with many flags get more.
EXAMPLES = {"plan": 6, "serve-bench": 8, "batch-size": 6, "memory": 8, "replay": 6, "schedule": 8}
DEFAULT_EXAMPLES = 6
# What a command needs besides its required flags to do its work (a plan needs a model), given to half the runs.
BASE = {"plan": ["--params", "1e9"], "batch-size": ["--budget-gb", "4"]}

# What each command would start, replaced by a stand-in: the command's parsing and checks run, the start does not.
STARTS = ["gpucourse.train.run", "gpucourse.course.slurm.submit", "gpucourse.course.slurm.check", "gpucourse.course.slurm.job",
          "gpucourse.course.slurm.wait", "gpucourse.course.slurm.cancel", "gpucourse.bench.main", "gpucourse.course.tour.main",
          "gpucourse.course.bandwidth.measure", "gpucourse.course.troubleshoot.run", "gpucourse.grading.runner.grade",
          "gpucourse.grading.runner.grade_class", "gpucourse.quiz.terminal.run_quiz",
          "gpucourse.quiz.terminal.run_exam", "gpucourse.workshop.hub.start", "gpucourse.workshop.hub.stop",
          "gpucourse.workshop.hub.remove_users", "gpucourse.workshop.kernels.check",
          "gpucourse.workshop.collect.collect", "gpucourse.workshop.report.status",
          "gpucourse.course.lab.install_course_defaults", "os.execv"]

EDGES = ["0", "-1", "", "nan", "inf", str(10**30)]  # the edges most values meet, drawn more often than the rest
EDGE_TEXT = EDGES + ["-inf", "1e308", "1e999", " ", "abc", "1.5", "0x10", "nosuch", "H100", "ä", "1e-320", "-0"]


# In the suite the first failing argument vector is reported as drawn: shrinking reruns slow commands many times,
# and explaining traces every line of every run. scripts/fuzz-cli shrinks it (GPUCOURSE_FUZZ_SHRINK=1): a longer
# run can afford to find the smallest vector that still fails.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + ((Phase.shrink,) if os.environ.get("GPUCOURSE_FUZZ_SHRINK")
                                                          == "1" else ())


class Started(Exception):
    """What a stand-in raises where a command would have started ranks, a server or a job."""


class Hang(Exception):
    """A run went past its time limit."""


# --- the files a flag may be given ------------------------------------------------------------------------------------

def synthetic_trace() -> list[dict]:
    """Three requests as gpucourse.serving.save_trace writes them."""
    return [{"id": i, "arrival_s": 0.1 * i, "prompt": [1 + i, 2, 3], "max_new_tokens": 4, "output_len": 3}
            for i in range(3)]


def _spoilt(good, path=()):
    """Each way of spoiling a JSON value one field at a time: (where, the spoilt whole)."""
    if isinstance(good, dict):
        for key, value in good.items():
            yield f"{'.'.join(map(str, path + (key,)))} removed", {k: v for k, v in good.items() if k != key}
            for where, bad in _spoilt(value, path + (key,)):
                yield where, {**good, key: bad}
    elif isinstance(good, list) and good:
        for where, bad in _spoilt(good[0], path + (0,)):
            yield where, [bad, *good[1:]]
    else:
        for bad in (math.nan, math.inf, -1, None, "x", [], {}, 10**30):
            if bad != good:
                yield f"{'.'.join(map(str, path))}={bad!r}", bad


FILE_NAME = re.compile(r"[^\w.-]+")  # what a file's name may not hold


@dataclasses.dataclass
class Files:
    """A folder of files for the fuzzer's path values: good ones of each file kind, and spoilt ones."""

    folder: Path
    good: dict  # "run" or "trace" (a word of its ReadableFile's `what`) -> a good file of that kind
    spoilt: list  # files that are not what any flag takes: named for the kind and the field spoilt

    @classmethod
    def make(cls, folder: Path) -> "Files":
        folder.mkdir(parents=True, exist_ok=True)
        good = {}
        for what, value in (("run", one_rank_run()), ("trace", synthetic_trace())):
            good[what] = folder / f"good-{what}.json"
            good[what].write_text(json.dumps(value))
        texts = {"empty": "", "text": "not json", "object": "{}", "list": "[]", "number": "[1]", "null": "null",
                 "string": '"x"', "deep": "[" * 5000, "binary": "\udcff"}
        spoilt = []
        for name, text in texts.items():
            path = folder / f"{name}.json"
            path.write_bytes(text.encode(errors="surrogateescape"))
            spoilt.append(path)
        for what, value in (("run", one_rank_run()), ("trace", synthetic_trace())):
            for i, (where, bad) in enumerate(_spoilt(value)):
                path = folder / f"{what}-{i}-{FILE_NAME.sub('-', where)[:60]}.json"
                path.write_text(json.dumps(bad))
                spoilt.append(path)
        (folder / "a-folder").mkdir(exist_ok=True)
        return cls(folder, good, spoilt)

    def for_kind(self, kind: ReadableFile) -> list[str]:
        return [str(p) for what, p in self.good.items() if what in kind.what]

    def edges(self) -> list[str]:
        return [str(self.folder / "a-folder"), str(self.folder / "missing" / "x.json"), str(self.folder / "nope.json")]


# --- the commands, read from the parser -------------------------------------------------------------------------------

def commands(parser=None, path=()):
    """Every command line of gpucourse that runs something: (its words, its parser)."""
    parser = parser or cli.build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, path + (name,))
            return
    yield path, parser


def _flag(action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def _good(action, files: Files) -> list[str]:
    """Values the action takes as given (a few, for a flag to be given well beside one given badly)."""
    kind = action.type
    if isinstance(kind, ReadableFile):
        return files.for_kind(kind) or [str(files.good["run"])]
    if isinstance(kind, Name):
        return kind.names()
    if action.choices:
        return [str(c) for c in action.choices]
    if isinstance(kind, Kind):
        found = []
        for text in ("1", "2", "4", "8", "0", "3", "16", "0.5", "64", "0.05", "1024", "1e6", "7e9"):
            with contextlib.suppress(ConfigError):
                kind.from_text(text, "--x")
                found.append(text)
        return found or ([] if action.default is None else [str(action.default)])
    if action.default not in (None, argparse.SUPPRESS) and not isinstance(action.default, (list, tuple)):
        return [str(action.default)]
    return ["out.json", "x"]


def _bad(action, files: Files):
    """Bad texts for ``action``: the edges of a value, and where it may name a file, files that are not one."""
    edges = st.one_of(st.sampled_from(EDGES), st.sampled_from(EDGE_TEXT))
    if isinstance(action.type, ReadableFile) or action.type is None or action.type is str:
        return st.one_of(edges, st.sampled_from([str(p) for p in files.spoilt] + files.edges()))
    return edges


def _values(action, files: Files):
    """One or more texts for ``action``, each good two times in three (so that many runs get past the parsing and
    the checks, where the rest of a command's faults are), else bad."""
    n = action.nargs
    good, bad = _good(action, files), _bad(action, files)
    one = st.sampled_from([True, True, False]).flatmap(lambda well: st.sampled_from(good) if well and good else bad)
    if n is None:
        return st.lists(one, min_size=1, max_size=1)
    if isinstance(n, int):
        return st.lists(one, min_size=n, max_size=n)
    return st.lists(one, min_size=0 if n in ("?", "*") else 1, max_size=1 if n == "?" else 2)


def _takes_value(action) -> bool:
    return action.nargs != 0 and not isinstance(action, (argparse._StoreConstAction, argparse._CountAction,
                                                         argparse.BooleanOptionalAction, argparse._HelpAction,
                                                         argparse._VersionAction))


@st.composite
def argv_for(draw, path, parser, files: Files):
    """An argument vector for the command ``path``: some of its flags, each given a good or a bad value."""
    actions = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._VersionAction))]
    options = [a for a in actions if a.option_strings]
    positionals = [a for a in actions if not a.option_strings]
    chosen = [a for a in options if a.required]
    chosen += draw(st.lists(st.sampled_from(options), max_size=4, unique_by=id)) if options else []
    argv = list(path) + draw(st.sampled_from([[], BASE.get(" ".join(path), [])]))
    for action in dict.fromkeys(chosen):  # in order, once each
        flag = draw(st.sampled_from(action.option_strings))
        argv.append(flag)
        if _takes_value(action):
            argv += draw(_values(action, files))
    for action in positionals:
        argv += draw(_values(action, files))
    mistake = draw(st.sampled_from(["none"] * 12 + ["unknown", "cut", "no value"]))
    flags = [s for a in options for s in a.option_strings if s.startswith("--") and len(s) > 4]
    if mistake == "unknown":
        argv.append("--no-such-flag")
    elif mistake == "cut" and flags:
        argv.append(draw(st.sampled_from(flags))[:-2])  # an abbreviation
    elif mistake == "no value" and argv[len(path):]:
        argv = argv[:-1] if argv[-1] not in path else argv
    return argv


# --- one run ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    argv: list
    code: object = None
    out: str = ""
    err: str = ""
    raised: str = ""
    hung: bool = False


def run_main(argv: list[str], limit_s: float = CASE_S) -> Outcome:
    """``gpucourse ARGV`` in this process, its output captured, stopped after ``limit_s`` seconds."""
    outcome, out, err = Outcome(argv), io.StringIO(), io.StringIO()

    def alarm(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            outcome.code = cli.main(argv)
    except SystemExit as e:
        outcome.code = e.code
    except Started:
        outcome.code = 0
    except Hang:
        outcome.hung = True
    except BaseException:  # noqa: BLE001 (what escapes is what the fuzzer looks for)
        outcome.raised = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    outcome.out, outcome.err = out.getvalue(), err.getvalue()
    return outcome


# A float that is no number, as Python prints it, inside a line (a name at the start of one, as a scenario called
# "nan" in troubleshoot's list, is a name).
NOT_A_NUMBER = re.compile(r"[^\n\w.-](-?(nan|inf))(?![\w-])")


def problem(o: Outcome) -> str | None:
    """What is wrong with a run's outcome, or None: status 0 and sane output, or one sentence on stderr."""
    shown = f"gpucourse {' '.join(map(repr, o.argv))}"
    if o.hung:
        return f"{shown} ran past {CASE_S:g} s"
    if o.raised:
        return f"{shown} raised:\n{o.raised}"
    if "Traceback" in o.out + o.err:
        return f"{shown} printed a traceback:\n{o.out}{o.err}"
    if o.code in (0, None):  # a word the command was given and says back (a file called inf) is no number
        bad = [m.group(1) for m in NOT_A_NUMBER.finditer(o.out) if m.group(1) not in o.argv]
        return f"{shown} printed {bad[0]!r}:\n{o.out}" if bad else None
    lines = o.err.strip().splitlines()
    if len(lines) != 1 or not lines[0].rstrip().endswith("."):
        return f"{shown} exited {o.code} with stderr not one sentence:\n{o.err!r}"
    return None


# --- the fuzzing -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return Files.make(tmp_path_factory.mktemp("fuzz-files"))


@pytest.fixture
def stand_ins(monkeypatch, tmp_path):
    """Every start replaced by a stand-in; the commands run in a folder of their own."""
    import importlib

    def started(*args, **kwargs):
        raise Started()

    for target in STARTS:
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, started)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPUCOURSE_WORKSHOP", str(tmp_path / "workshop"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def plain(path, parser, files: Files) -> list[str]:
    """The command with what it needs and nothing else: the first good value of each required flag."""
    argv = [*path, *BASE.get(" ".join(path), [])]
    for action in parser._actions:
        if action.required:
            argv += ([action.option_strings[0]] if action.option_strings else []) + _good(action, files)[:1]
    return argv


def fuzz(path, parser, files: Files, examples: int) -> None:
    """Run the command as ``plain`` gives it, then draw ``examples`` argument vectors for it and run each; fail on
    the first bad outcome."""
    found = problem(run_main(plain(path, parser, files)))
    assert found is None, found

    @settings(max_examples=max(1, round(examples * SCALE)), deadline=None, derandomize=SEED is None, database=None,
              suppress_health_check=list(HealthCheck), phases=PHASES)
    @given(st.data())
    def case(data):
        argv = data.draw(argv_for(path, parser, files), label="argv")
        outcome = run_main(argv)
        if SHOW:
            print(f"{outcome.code} {' '.join(map(repr, argv))}", file=sys.__stdout__)
        found = problem(outcome)
        assert found is None, found

    if SEED is not None:
        case = seed(int(SEED))(case)
    case()


COMMANDS = dict(commands())


def test_a_file_spoilt_in_any_field_is_refused_in_one_sentence_or_read(files, stand_ins):
    """Each field of a saved run and of a trace spoilt in turn (left out, NaN, infinite, -1, null, text, a list, an
    object, huge), and files that are no JSON of the kind: the commands that read them refuse them in one sentence,
    or read them. The suite tries every fourth; scripts/fuzz-cli tries them all."""
    for path in files.spoilt[::1 if SCALE > 1 else 4]:
        readers = {"run": [["replay", str(path)]], "trace": [["serve-bench", "--trace", str(path), "--quiet"]]}
        for argv in readers.get(path.name.split("-")[0], [*readers["run"], *readers["trace"]]):
            found = problem(run_main(argv))
            assert found is None, found


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_every_command_answers_any_input_with_a_result_or_one_sentence(path, files, stand_ins):
    fuzz(path, COMMANDS[path], files, EXAMPLES.get(" ".join(path), DEFAULT_EXAMPLES))


def test_every_command_and_flag_is_reached():
    """The walk finds the commands nested in others (workshop start) and every flag of each."""
    assert {("plan",), ("serve-bench",), ("workshop", "start"), ("workshop", "collect"), ("train",)} <= set(COMMANDS)
    flags = {s for parser in COMMANDS.values() for a in parser._actions for s in a.option_strings}
    assert {"--tpot-ms", "--efficiency", "--prompt-lens", "--seats", "--kv-heads", "--trace"} <= flags


# --- the fuzzer finds what it is for --------------------------------------------------------------------------------

def _planted_parser(behave):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.add_parser("planted")
    p.add_argument("--every", type=int, default=4, help="a flag added without a kind of value")
    p.add_argument("--name", default="a")
    p.set_defaults(func=behave)
    return parser


@pytest.mark.parametrize("behave, finds", [
    (lambda args: print(100 // args.every) or 0, "ZeroDivisionError"),  # --every 0
    (lambda args: print(f"throughput {1e308 * args.every:.3g} tokens/s") or 0, "printed 'inf'"),  # it overflows
    (lambda args: print("no.\nreally not.", file=sys.stderr) or 2 if args.every < 1 else 0, "not one sentence"),
])
def test_a_planted_fault_makes_the_fuzzer_fail(behave, finds, files, stand_ins, monkeypatch):
    parser = _planted_parser(behave)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    planted = dict(commands(parser))[("planted",)]
    with pytest.raises(AssertionError, match=finds):
        fuzz(("planted",), planted, files, 300)  # a run of the planted command takes a millisecond


def test_a_planted_hang_is_stopped_and_reported(stand_ins, monkeypatch):
    def forever(args):
        while True:
            pass

    parser = _planted_parser(forever)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    found = run_main(["planted"], limit_s=0.5)
    assert found.hung and "ran past" in problem(found)


# --- the functions notebooks call with a learner's values ------------------------------------------------------------

NUMBER_EDGES = [0, -1, math.nan, math.inf, -math.inf, 1e308, 10**30, None, "x", True, 2.5]


def _either(good: list, edges=NUMBER_EDGES):
    return st.one_of(st.sampled_from(good), st.sampled_from(edges))


def refuses_in_one_sentence(call) -> None:
    """``call()`` returns, or raises ConfigError/ValueError in one sentence; nothing else, and within the limit."""
    def alarm(*_):
        raise Hang()

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_S)
    try:
        call()
    except Hang:
        raise AssertionError(f"ran past {CASE_S:g} s") from None
    except ValueError as e:  # ConfigError, ShapeError and the lessons' own ValueErrors
        assert "\n" not in str(e) and str(e).endswith("."), repr(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def notebook_settings(examples: int):
    return settings(max_examples=max(1, round(examples * SCALE)), deadline=None, derandomize=SEED is None,
                    database=None, suppress_health_check=list(HealthCheck), phases=PHASES)


@notebook_settings(8)
@given(params=_either([7e9, 1e6]), gpus=_either([8, 16]), batch_size=_either([64, 1024]),
       seq_len=_either([1024, 4096]), efficiency=_either([None, 0.5]), gpu=_either(["h100", "a100"], ["h900", "", 3]),
       shape=_either([None, "llama3-8b"], [{"layers": -1, "hidden": 64, "heads": 2}, "nosuch", 5]))
def test_the_training_planner_takes_any_value_or_refuses_it(params, gpus, batch_size, seq_len, efficiency, gpu,
                                                             shape):
    from gpucourse.modeled import plan

    refuses_in_one_sentence(lambda: plan.plan(params, gpus, gpu=gpu, batch_size=batch_size, seq_len=seq_len,
                                              efficiency=efficiency, shape=shape))


@notebook_settings(10)
@given(shape=_either(["llama3-8b", "mixtral-8x7b"], ["nosuch", {"layers": 2}, None]), gpus=_either([1, 8]),
       context=_either([512, 4096]), tpot_s=_either([0.05]), weights=_either(["bf16", "fp8"], ["fp4", None]),
       gpu=_either(["h100"], ["nosuch"]))
def test_the_serving_planner_takes_any_value_or_refuses_it(shape, gpus, context, tpot_s, weights, gpu):
    from gpucourse.modeled import serve_plan

    refuses_in_one_sentence(lambda: serve_plan.plan(shape, gpus, gpu=gpu, context=context, tpot_s=tpot_s,
                                                    weights=weights))
    refuses_in_one_sentence(lambda: serve_plan.memory(shape, context, tp=gpus, weights=weights, gpu=gpu))


@notebook_settings(12)
@given(dp=_either([1, 2]), pp=_either([1, 2]), microbatches=_either([1, 4]), batch_size=_either([8, 16]),
       seq_len=_either([32, 64]), zero=_either([0, 3], [4, -1, None]), precision=_either(["fp32", "bf16"], ["fp8", 3]),
       num=_either([1e6, 7e9]))
def test_the_memory_estimates_take_any_value_or_refuse_it(dp, pp, microbatches, batch_size, seq_len, zero, precision,
                                                           num):
    from gpucourse.modeled import memory
    from gpucourse.config import TrainConfig

    refuses_in_one_sentence(lambda: memory.estimate(TrainConfig(dp=dp, pp=pp, microbatches=microbatches, zero=zero,
                                                                batch_size=batch_size, seq_len=seq_len,
                                                                precision=precision)))
    refuses_in_one_sentence(lambda: memory.estimate_params(num, dp, zero, precision))


REQUEST_FIELDS = {"id": _either([0, 1, 2], [-1, "x", None, 1.5]),
                  "arrival_s": _either([0.0, 0.5, 2.0]),
                  "prompt": st.one_of(st.lists(_either([1, 5, 60], [-1, 64, 10**6, "x", None, 1.5]), max_size=80),
                                      st.sampled_from([None, "abc", 3, {}])),
                  "max_new_tokens": _either([1, 4, 30]), "output_len": _either([None, 1, 3])}


@st.composite
def trace_texts(draw):
    rows = draw(st.lists(st.fixed_dictionaries({}, optional=REQUEST_FIELDS), max_size=4))
    whole = draw(st.sampled_from(["rows"] * 8 + ["object", "number", "text"]))
    if whole == "rows":
        return json.dumps(rows)
    return {"object": json.dumps({"requests": rows}), "number": "3", "text": "requests"}[whole]


@notebook_settings(25)
@given(text=trace_texts(), clock=st.sampled_from(["modeled", "wall"]))
def test_any_trace_file_is_served_or_refused_in_one_sentence(text, clock, stand_ins, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(text)
    found = problem(run_main(["serve-bench", "--trace", str(path), "--clock", clock, "--quiet"]))
    assert found is None, found


def test_a_longer_run_shows_the_failing_vector_shrunk(files, stand_ins, monkeypatch):
    """scripts/fuzz-cli shrinks what it finds: the planted division by --every is shown as the smallest vector that
    still fails, the command and --every 0 alone."""
    parser = _planted_parser(lambda args: print(100 // args.every) or 0)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    monkeypatch.setattr(sys.modules[__name__], "PHASES", PHASES + (Phase.shrink,))
    planted = dict(commands(parser))[("planted",)]
    with pytest.raises(AssertionError, match="ZeroDivisionError") as e:
        fuzz(("planted",), planted, files, 300)
    shown = "\n".join(getattr(e.value, "__notes__", []))
    assert "argv): ['planted', '--every', '0']" in shown, shown
