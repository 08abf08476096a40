"""Every command, and every function a notebook calls with a learner's values, answers bad input in one sentence
naming what was given, the value and what is allowed: one test for each case found by hand (the fuzzer,
tests/test_fuzz_cli.py, looks for the rest)."""

from __future__ import annotations

import json
import math

import pytest

from gpucourse.parallel import check
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
    (SEED, -1, "n=-1 must be at least 0."),
    (SEED, 2**40, f"n={2**40} must be at most 4294967295 (what every random generator takes)."),
    (SEED, "7", "n='7' must be a whole number from 0 to 4294967295."),
    (whole(2, 4), 5, "n=5 must be at most 4."),
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

        check(TrainConfig(seq_len=0), runnable=False)


# --- plan, memory --serve ---------------------------------------------------------------------------------------------

def test_plan_refuses_a_gpu_the_table_does_not_hold(capsys):
    known = "is not in the GPU table; known: h100, h200, b200, a100, l4, cpu"
    assert refused(capsys, ["plan", "--params", "7e9", "--gpus", "8", "--gpu", "h900"]).startswith(
        f"--gpu 'h900' {known} (did you mean h200 or h100?)")
    assert refused(capsys, ["plan", "--serve", "--shape", "llama3-8b", "--gpus", "8", "--gpu", "nosuch"]).startswith(
        f"--gpu 'nosuch' {known}")
    from gpucourse.modeled import plan, serve_plan

    for call in (lambda: plan.plan(7e9, 8, gpu="h900"), lambda: serve_plan.plan("llama3-8b", 8, gpu="nosuch")):
        with pytest.raises(ConfigError, match="is not in the GPU table"):
            call()


@pytest.mark.parametrize("flag, value, says", [
    ("--batch-size", "-4", "--batch-size -4 must be at least 1."),
    ("--batch-size", "0", "--batch-size 0 must be at least 1."),
    ("--seq-len", "0", "--seq-len 0 must be at least 1."),
    ("--efficiency", "7", "--efficiency 7 must be at most 1 (a share of the GPU's peak FLOP/s)."),
])
def test_plan_refuses_a_batch_a_sequence_or_an_efficiency_that_is_no_run(capsys, flag, value, says):
    assert refused(capsys, ["plan", "--params", "7e9", "--gpus", "8", flag, value]) == says
    from gpucourse.modeled import plan

    name = flag[2:].replace("-", "_")
    value = float(value) if name == "efficiency" else int(value)
    with pytest.raises(ConfigError, match=f"{name}={value} must be at"):
        plan.plan(7e9, 8, **{name: value})


@pytest.mark.parametrize("flag, value, says", [
    ("--vocab", "0", "--vocab 0 must be at least 1."),
    ("--ffn", "-1", "--ffn -1 must be at least 0."),
    ("--kv-heads", "-8", "--kv-heads -8 must be at least 0."),
])
def test_plan_refuses_shape_parts_no_model_has(capsys, flag, value, says):
    assert refused(capsys, ["plan", "--shape", "llama3-8b", "--gpus", "8", flag, value]) == says
    from gpucourse.modeled import plan

    name = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"{name}={value} must be at least"):
        plan.plan(None, 8, shape={"layers": 2, "hidden": 256, "heads": 4, name: int(value)})


def test_tp_degrees_the_heads_rule_out_are_said_once(capsys):
    """Twelve heads on 8 GPUs: tp 8 cannot split them. The plan used to drop those layouts without a word."""
    parts = ["--layers", "4", "--hidden", "768", "--heads", "12", "--vocab", "1000"]
    assert cli.main(["plan", "--gpus", "8", "--batch-size", "8", "--seq-len", "256", *parts]) == 0
    out = capsys.readouterr().out
    assert out.count("note: tp 8 left out: tensor parallelism must divide the model's 12 attention heads.") == 1
    assert cli.main(["plan", "--serve", "--gpus", "8", "--context", "256", *parts]) == 0
    assert capsys.readouterr().out.count("note: tp 8 left out") == 1
    assert cli.main(["plan", "--params", "7e9", "--gpus", "8", "--top", "1"]) == 0
    assert "note:" not in capsys.readouterr().out  # nothing was left out


def test_a_data_parallel_degree_that_does_not_divide_the_batch_is_said(capsys):
    assert cli.main(["plan", "--params", "7e9", "--gpus", "6", "--batch-size", "1000", "--top", "1"]) == 0
    assert "note: dp 3 and 6 left out: data parallelism must divide the batch of 1000 sequences." in \
        capsys.readouterr().out


def test_memory_serve_defaults_to_bf16_weights_and_a_serving_context(capsys):
    """It took training's defaults (fp32, 64-token sequences); serving stores bf16 and holds thousands of tokens."""
    assert cli.main(["memory", "--serve", "--shape", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "weights bf16" in out and "sequences of 4096 tokens" in out and "16.06 GB" in out
    assert cli.main(["memory", "--serve"]) == 0  # the course's tiny model: its whole context, 128 tokens
    assert "weights bf16" in (out := capsys.readouterr().out) and "sequences of 128 tokens" in out
    assert cli.main(["memory"]) == 0 and "fp32" in capsys.readouterr().out  # training keeps its own
    assert refused(capsys, ["memory", "--precision", "fp8"]).startswith("--precision 'fp8' is not one of fp32, bf16")
    assert refused(capsys, ["memory", "--serve", "--precision", "fp16"]).startswith(
        "--precision 'fp16' is not one of fp32, bf16, fp8")
    helps = {a.dest: a.help for a in cli.build_parser()._subparsers._group_actions[0].choices["memory"]._actions}
    assert "(default fp32)" in helps["precision"] and "(default bf16)" in helps["precision"]
    assert "(default 64)" in helps["seq_len"] and "(default 4096" in helps["seq_len"]


# --- serve-bench ------------------------------------------------------------------------------------------------------

def _json_file(tmp_path, value, name="trace.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(value))
    return str(path)


def _request(**changed) -> dict:
    return {"id": 0, "arrival_s": 0.0, "prompt": [1, 2, 3], "max_new_tokens": 4, **changed}


@pytest.mark.parametrize("clock", ["modeled", "wall"])
def test_a_request_that_asks_for_no_token_is_refused(tmp_path, capsys, clock):
    """max_new_tokens 0: a RuntimeError on the modeled clock ("planned nothing"), an IndexError on the wall clock."""
    path = _json_file(tmp_path, [_request(max_new_tokens=0)])
    assert refused(capsys, ["serve-bench", "--trace", path, "--clock", clock, "--quiet"]) == \
        f"--trace {path} is not a request trace: request 0's max_new_tokens=0 must be at least 1."


def test_a_token_outside_the_vocabulary_is_refused_before_the_model_sees_it(tmp_path, capsys):
    path = _json_file(tmp_path, [_request(prompt=[1, 2000])])
    assert refused(capsys, ["serve-bench", "--trace", path, "--clock", "wall", "--quiet"]) == \
        "request 0's prompt holds token 2000, outside the model's vocabulary of 64 (token ids 0 to 63)."


def test_an_empty_trace_is_refused(tmp_path, capsys):
    from gpucourse.modeled.serve_clock import simulate

    path = _json_file(tmp_path, [])
    assert refused(capsys, ["serve-bench", "--trace", path]).endswith(
        "is not a request trace: a trace is a JSON list of one or more requests; this one is empty.")
    with pytest.raises(ValueError, match="the trace holds no requests"):
        simulate([], 8, 16)


def test_generated_lengths_go_from_the_smaller_to_the_larger(capsys):
    from gpucourse.serving import poisson_trace

    assert refused(capsys, ["serve-bench", "--prompt-lens", "64", "16"]) == \
        "--prompt-lens 64 16 must go from the smaller to the larger."
    with pytest.raises(ConfigError, match=r"prompt_lens=\(64, 16\) must go from the smaller to the larger"):
        poisson_trace(4, 1.0, (64, 16), (8, 48))


def test_answers_of_no_token_are_refused(capsys):
    """--output-lens 0 0: every request finished before its first token, and the scheduler planned nothing."""
    assert refused(capsys, ["serve-bench", "--output-lens", "0", "0"]) == "--output-lens 0 must be at least 1."


def test_bursts_of_no_request_are_refused(capsys):
    """--burst 0 divided by zero."""
    from gpucourse.serving import poisson_trace

    assert refused(capsys, ["serve-bench", "--burst", "0"]) == "--burst 0 must be at least 1."
    with pytest.raises(ConfigError, match="burst=0 must be at least 1"):
        poisson_trace(4, 1.0, (1, 2), (1, 2), burst=0)


def test_an_arrival_that_is_no_time_is_refused_instead_of_served_for_ever(tmp_path, capsys):
    """An arrival_s of NaN is never <= the clock: the request waited for ever, and the command never ended."""
    from gpucourse.serving import Request

    path = tmp_path / "nan.json"
    path.write_text('[{"id": 0, "arrival_s": NaN, "prompt": [1], "max_new_tokens": 2}]')
    assert refused(capsys, ["serve-bench", "--trace", str(path)]).endswith(
        "request 0's arrival_s=nan must be a finite number of at least 0.")
    for arrival in (math.nan, math.inf, -1.0):
        with pytest.raises(ConfigError, match="arrival_s"):
            Request(0, arrival, (1,), 2)


def test_serve_bench_has_no_tp_flag_to_take_for_tpot_ms(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve-bench", "--tp", "3"])
    assert "--tp is not a flag of gpucourse serve-bench; the nearest: --tpot-ms" in capsys.readouterr().err


@pytest.mark.parametrize("clock", ["modeled", "wall"])
def test_the_modeled_clock_holds_requests_to_the_models_context_as_the_wall_clock_does(tmp_path, capsys, clock):
    """The modeled clock served a 200-token prompt for a 128-token model, and an empty prompt."""
    long = _json_file(tmp_path, [_request(prompt=[1] * 200)], "long.json")
    assert refused(capsys, ["serve-bench", "--trace", long, "--clock", clock, "--quiet"]) == \
        "request 0 of 200 tokens is longer than the model's context of 128 tokens (block_size)."
    empty = _json_file(tmp_path, [_request(prompt=[])], "empty.json")
    assert refused(capsys, ["serve-bench", "--trace", empty, "--clock", clock]).endswith(
        "request 0's prompt must be a list of at least one token id (a model continues a prompt).")


def test_a_trace_of_one_token_answers_reports_its_kv_memory(tmp_path, capsys):
    """Found by the fuzzer: every request done in its first iteration left no KV slot held, and the waste shares
    divided 0 by 0."""
    path = _json_file(tmp_path, [_request(max_new_tokens=1)])
    assert cli.main(["serve-bench", "--trace", path, "--quiet"]) == 0
    assert "0.0% of paged slots empty" in capsys.readouterr().out


# --- parallel decode ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["tp", "dp"])
def test_parallel_decode_runs_without_a_recorder(kind):
    """decode(model, layout, prompts, n) with its default rec=None raised a TypeError for tp and dp: its forward
    pre-hook returned True, which replaced the model's input."""
    import torch
    import torch.distributed as dist

    from gpucourse.model import MODELS, build_model
    from gpucourse.serving import generate
    from gpucourse.serving.parallel_decode import Layout, decode

    prompts = [[1, 2, 3], [4, 5]]
    want = generate(build_model(MODELS["tiny"], 0), prompts, 4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        got = decode(build_model(MODELS["tiny"], 0), Layout(kind, 1), prompts, 4)
    finally:
        dist.destroy_process_group()
    assert torch.equal(got, want)


# --- found by the fuzzer (tests/test_fuzz_cli.py) ------------------------------------------------------------------

def test_plan_refuses_more_gpus_than_any_cluster_holds_instead_of_counting_their_divisors(capsys):
    """--gpus 10**30 listed the divisors of 10**30 one number at a time: the command never ended."""
    assert refused(capsys, ["plan", "--params", "1e9", "--gpus", str(10**30)]) == \
        f"--gpus {10**30} must be at most 1048576 (more GPUs than any cluster holds)."
    from gpucourse.modeled import plan

    with pytest.raises(ConfigError, match="gpus_per_node=2000 must be at most 1024"):
        plan.plan(1e9, 8, gpus_per_node=2000)


def test_a_layout_of_more_ranks_than_any_cluster_is_refused_before_its_ranks_are_counted(capsys):
    """memory --dp 10**30 --batch-size 10**30 sized every one of 10**30 ranks."""
    assert refused(capsys, ["memory", "--dp", "1048576", "--tp", "2", "--batch-size", "1048576"]) == \
        "pp × dp × cp × tp=2097152 must be at most 1048576 (more GPUs than any cluster holds)."


def test_schedule_refuses_a_clock_it_cannot_lay_out_in_seconds(capsys):
    """64 stages of 1024 microbatches took half a minute and half a gigabyte; a million took the fuzzer's hour."""
    assert refused(capsys, ["schedule", "--pp", "64", "--microbatches", "1024"]) == \
        "--pp 64 × --microbatches 1024 × 1 chunk(s) a rank = 65536 forwards on the clock, more than it lays out " \
        "quickly (at most 8192); use fewer."


def test_batch_size_says_in_one_sentence_on_stderr_that_nothing_fits(capsys):
    """It exited 1 with its answer on stdout and nothing on stderr."""
    assert cli.main(["batch-size", "--budget-gb", "1e-9"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err == "gpucourse: not even one sequence per microbatch fits in 1e-09 GiB (estimated).\n"


def test_memory_serve_checks_the_model_as_training_does(capsys):
    """memory --serve --moe-experts 1 built a shape whose top-2 routing had one expert: a ShapeError traceback."""
    assert refused(capsys, ["memory", "--serve", "--moe-experts", "1"]) == \
        "moe_experts=1: a mixture needs at least 2 experts."
    assert refused(capsys, ["memory", "--serve", "--seq-len", "500"]) == \
        "seq_len=500 is longer than model 'tiny''s block_size=128."


def test_schedule_costs_stay_within_what_its_clock_adds_up(capsys):
    """--cost-comm 1e308 made the makespan infinite, and rounding it an OverflowError."""
    assert refused(capsys, ["schedule", "--cost-comm", "1e308"]) == "--cost-comm 1e308 must be at most 1e+06."


def test_bandwidth_refuses_sizes_it_could_not_allocate(capsys):
    """--sizes inf was an OverflowError; 1e15 bytes would have been allocated on every rank."""
    assert refused(capsys, ["bandwidth", "--sizes", "inf"]) == \
        "size 'inf' is more than 4 GiB, where every link's bus bandwidth has long levelled off; give a smaller one."


def test_serve_bench_refuses_a_pool_it_could_not_hold(capsys):
    """--blocks 10**30 listed every block (an OverflowError); a pool of 100000 blocks decoded on the wall clock would
    have allocated 3 GiB of keys and values."""
    assert refused(capsys, ["serve-bench", "--blocks", str(10**30)]).startswith(f"--blocks {10**30} must be at most")
    assert refused(capsys, ["serve-bench", "--clock", "wall", "--blocks", "100000"]) == \
        "--blocks 100000 of --block-size 16 tokens hold 3.05 GiB of keys and values for model 'tiny', more than " \
        "--clock wall allocates here (1 GiB); use fewer."
    assert refused(capsys, ["serve-bench", "--requests", str(10**30)]).startswith(f"--requests {10**30} must be")


def one_rank_run() -> dict:
    """A one-rank run as ``gpucourse train --json`` saves it: two steps of forward, backward and optimizer spans."""
    from gpucourse.config import TrainConfig

    spans, t = [], 0.0
    for step in range(2):
        spans.append({"rank": 0, "step": step, "kind": "step", "name": "step", "microbatch": None,
                      "start_s": t, "end_s": t + 0.06})
        for kind, length in (("forward", 0.01), ("backward", 0.02), ("optimizer", 0.01)):
            spans.append({"rank": 0, "step": step, "kind": kind, "name": kind,
                          "microbatch": None if kind == "optimizer" else 0, "start_s": t, "end_s": t + length})
            t += length
        t += 0.02
    return {"config": TrainConfig(precision="fp32").to_dict(), "world_size": 1, "device": "cpu", "backend": "gloo",
            "losses": [4.1, 3.9], "step_times_s": [0.06, 0.06], "tokens_per_s": 8 * 64 / 0.06, "timeline": spans,
            "comm_bytes": {}, "comm": [], "memory": {}, "extras": {}, "start_step": 0}



def test_a_saved_run_spoilt_in_a_field_is_refused_saying_which(tmp_path, capsys):
    """A saved run with a NaN loss, a span on a rank the run has not, or a layout the model cannot take went on into
    the replay and ended in a TypeError, a KeyError or 'nan' in the table."""
    for change, says in (({"losses": [math.nan, 3.9]}, "losses[0]=nan must be a finite number."),
                         ({"timeline": [{**one_rank_run()["timeline"][0], "rank": 3}]},
                          "timeline[0].rank=3 must be at most 0 (the run has 1 rank)."),
                         ({"config": {**one_rank_run()["config"], "moe_experts": 10**30}},
                          f"moe_experts={10**30} must be at most 1024 (the course model holds every expert's "
                          f"weights)."),
                         ({"world_size": 2}, "a saved run's world_size=2 is not its layout's 1 ranks.")):
        path = _json_file(tmp_path, {**one_rank_run(), **change}, "run.json")
        assert refused(capsys, ["replay", path]) == \
            f"{path} is not a run saved with 'gpucourse train --json FILE': {says}"


@pytest.mark.parametrize("value, said", [("0", "--gpus-per-node 0 must be at least 1."),
                                         ("x", "--gpus-per-node x must be a whole number from 1 to 1024.")])
def test_train_print_configs_gpus_per_node_is_refused_by_its_kind(value, said, capsys):
    from gpucourse import cli

    assert cli.main(["train", "--print-config", "megatron", "--dp", "2", "--gpus-per-node", value]) == 2
    assert capsys.readouterr().err.strip() == f"gpucourse: error: {said}"
