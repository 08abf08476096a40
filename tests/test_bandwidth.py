"""Bandwidth: rows for 2 ranks are positive, bus bandwidth is algorithm bandwidth times exactly
nccl-tests' factor, sizes parse in binary units, and bad flags are refused before any rank starts."""

from __future__ import annotations

import json

import pytest

from gpucourse import cli
from gpucourse.course import bandwidth
from gpucourse.readable import human_bytes

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leftover_children")]

NCCL_TESTS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                     "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def test_two_ranks_give_positive_rows_with_the_nccl_tests_factor(tmp_path, capsys):
    path = tmp_path / "bw.json"
    assert cli.main(["bandwidth", "--world-size", "2", "--sizes", "4K,64K", "--quick", "--json", str(path)]) == 0
    measured = json.loads(path.read_text())
    rows = measured["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, size) for op in bandwidth.OPS for size in (4096, 65536)]
    for row in rows:
        assert row["time_s"] > 0 and row["algbw_GBps"] > 0 and row["busbw_GBps"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] / row["algbw_GBps"] == pytest.approx(NCCL_TESTS_FACTOR[row["op"]](2), rel=1e-12)
    assert measured["memcpy"]["bytes"] == 65536 and measured["memcpy"]["GBps"] > 0
    printed = capsys.readouterr().out
    assert "busbw" in printed and "memory copy of 64 KiB" in printed


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bus_factor_is_nccl_tests(n):
    for op, factor in NCCL_TESTS_FACTOR.items():
        assert bandwidth.bus_factor(op, n) == factor(n)


def test_sizes_parse_in_binary_units():
    assert bandwidth.parse_size("1K") == bandwidth.parse_size("1KB") == 1024
    assert bandwidth.parse_size("64MB") == 64 << 20
    assert bandwidth.parse_size("4096") == 4096
    assert human_bytes(64 << 20, binary=True) == "64 MiB" and human_bytes(1536, binary=True) == "1.50 KiB"
    for bad in ("0", "-1K", "1Q", "MB", ""):
        with pytest.raises(ValueError):
            bandwidth.parse_size(bad)


def test_memcpy_bandwidth_here():
    copy = bandwidth.memcpy_bandwidth(1 << 20)
    assert copy["bytes"] == 1 << 20 and copy["time_s"] > 0
    assert copy["GBps"] == pytest.approx(copy["bytes"] / copy["time_s"] / 1e9)


@pytest.mark.parametrize("argv, words", [
    (["--ops", "all_reduce,gossip"], "gossip"),
    (["--sizes", "1Q"], "1Q"),
    (["--world-size", "1"], "at least 2"),
    (["--device", "tpu"], "--device 'tpu' is not one of auto, cpu, cuda"),
])
def test_bad_flags_are_refused(argv, words, capsys):
    assert cli.main(["bandwidth", *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_alpha_beta_fit_recovers_latency_and_bus_bandwidth():
    """Notebook 08 fits the measured sweep: a line through (bytes, time) gives α per ring step and the busbw."""
    alpha, busbw, n = 20e-6, 2.5e9, 4
    rows = [{"op": "all_reduce", "bytes": b, "time_s": 2 * (n - 1) * alpha + bandwidth.bus_factor("all_reduce", n)
             * b / busbw} for b in (4 << 10, 64 << 10, 1 << 20, 16 << 20)]
    fit = bandwidth.fit_alpha_beta(rows, "all_reduce", n)
    assert fit["alpha_s"] == pytest.approx(alpha) and fit["busbw_GBps"] == pytest.approx(busbw / 1e9)
    with pytest.raises(ValueError, match="two sizes"):
        bandwidth.fit_alpha_beta(rows[:1], "all_reduce", n)
