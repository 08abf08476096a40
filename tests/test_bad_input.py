"""Every command, and every function a notebook calls with a learner's values, answers bad input in one sentence
naming what was given, the value and what is allowed: one test for each case found by hand (the fuzzer,
tests/test_fuzz_cli.py, looks for the rest)."""

from __future__ import annotations

import json
import math

import pytest

from gpucourse import cli
from gpucourse.readable import ConfigError
from gpucourse.values import FRACTION, POSITIVE, POSITIVE_NUMBER, SEED, Name, ReadableFile, json_value, whole

pytestmark = pytest.mark.timeout(120)


def refused(capsys, argv: list[str]) -> str:
    """The one line a command that refuses ``argv`` prints, without its "gpucourse: error: " (status 2)."""
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert line.startswith("gpucourse: error: ") and line.endswith("."), line
    return line.removeprefix("gpucourse: error: ")


# --- the kinds of values --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, value, says", [
    (POSITIVE, 0, "n=0 must be at least 1."),
    (POSITIVE, True, "n=True must be a whole number of at least 1."),
    (POSITIVE, 2.0, "n=2.0 must be a whole number of at least 1."),
    (POSITIVE_NUMBER, math.nan, "n=nan must be a finite number more than 0."),
    (POSITIVE_NUMBER, -math.inf, "n=-inf must be a finite number more than 0."),
    (FRACTION, 7, "n=7 must be at most 1 (a share of the whole)."),
    (SEED, -1, "n=-1 must be from 0 to 4294967295 (what every random generator takes)."),
    (whole(2, 4), 5, "n=5 must be from 2 to 4."),
    (Name(("h100", "a100")), "h900", "n='h900' is not one of h100, a100 (did you mean h100?)."),
    (Name(("h100", "a100")), 3, "n=3 is not one of h100, a100."),
])
def test_a_value_a_kind_does_not_allow_is_refused_in_one_sentence(kind, value, says):
    with pytest.raises(ConfigError) as refusal:
        kind.check(value, "n")
    assert str(refusal.value) == says


@pytest.mark.parametrize("kind, text, says", [
    (POSITIVE, "0", "--n 0 must be at least 1."),
    (POSITIVE, "two", "--n two must be a whole number of at least 1."),
    (POSITIVE, "", "--n '' must be a whole number of at least 1."),
    (POSITIVE_NUMBER, "inf", "--n inf must be a finite number more than 0."),
    (POSITIVE_NUMBER, "1e999", "--n 1e999 must be a finite number more than 0."),
    (Name(("bf16", "fp8")), "fp9", "--n 'fp9' is not one of bf16, fp8 (did you mean fp8?)."),
])
def test_a_flag_names_itself_and_the_text_as_typed(kind, text, says):
    with pytest.raises(ConfigError) as refusal:
        kind.from_text(text, "--n")
    assert str(refusal.value) == says


def test_a_file_that_does_not_parse_is_refused_saying_why(tmp_path):
    def rows(text):
        found = json_value(text)
        if not isinstance(found, list):
            raise ValueError(f"it holds a {type(found).__name__}, not a list")
        return found

    kind = ReadableFile(rows, "a list of rows")
    files = {"empty": "", "text": "not json", "object": "{}", "bytes": b"\xff\xfe"}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    says = {"empty": "is not a list of rows: it is empty.",
            "text": "is not a list of rows: it is not JSON (Expecting value at line 1).",
            "object": "is not a list of rows: it holds a dict, not a list.",
            "bytes": "cannot be read as a list of rows ('utf-8' codec can't decode byte 0xff in position 0: "
                     "invalid start byte)."}
    for name, words in says.items():
        with pytest.raises(ConfigError) as refusal:
            kind.from_text(str(tmp_path / name), "--rows")
        assert str(refusal.value) == f"--rows {tmp_path / name} {words}"
    for path, words in ((tmp_path, "is a folder; give a list of rows."),
                        (tmp_path / "none", "does not exist; give a list of rows.")):
        with pytest.raises(ConfigError, match=words):
            kind.from_text(str(path), "--rows")
    (tmp_path / "deep").write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="it nests too deeply|it is not JSON"):
        kind.from_text(str(tmp_path / "deep"), "--rows")
    (tmp_path / "good").write_text(json.dumps([1, 2]))
    assert kind.from_text(str(tmp_path / "good"), "--rows") == [1, 2]


def test_every_number_flag_of_a_training_run_is_checked_as_typed(capsys):
    assert refused(capsys, ["train", "--dp", "0"]) == "--dp 0 must be at least 1."
    assert refused(capsys, ["memory", "--lr", "nan"]) == "--lr nan must be a finite number more than 0."
    assert refused(capsys, ["train", "--zero", "5"]) == "--zero 5 must be a ZeRO stage: 0, 1, 2 or 3."
    assert refused(capsys, ["memory", "--dropout", "1"]).startswith("--dropout 1 must be below 1")
    assert refused(capsys, ["memory", "--cp-algo", "rng"]) == \
        "--cp-algo 'rng' is not one of ring, allgather, ulysses (did you mean ring?)."
    with pytest.raises(ConfigError, match="seq_len=0 must be at least 1"):
        from gpucourse.config import TrainConfig

        TrainConfig(seq_len=0).validate(runnable=False)
