"""Bad layouts are refused before any rank starts, in one sentence naming the constraint."""

from __future__ import annotations

import pytest
import torch

from gpucourse.parallel import check
from gpucourse import ConfigError, TrainConfig
from gpucourse import cli


@pytest.mark.parametrize("kw, says", [
    (dict(tp=3), "tp=3 must divide n_head=4"),
    (dict(pp=5), "pp=5 is more than the 4 blocks"),
    (dict(pp=2, microbatches=3), "microbatches=3 must divide the batch of each data-parallel rank"),
    (dict(microbatches=2), "needs pp > 1"),
    (dict(pp=2, grad_accum=2, microbatches=3), "microbatches=3 must divide the batch of each data-parallel rank's "
                                                "accumulated part, batch_size / (dp × grad_accum) = 4 sequences"),
    (dict(dp=2, zero=2, impl="accelerate"), "offers DDP (zero=0) and FSDP (zero=3)"),
    (dict(tp=2, zero=1, dp=2, impl="torch"), "ZeRO-1 (ZeroRedundancyOptimizer) runs with data parallelism alone"),
    (dict(dp=2, tp=2, impl="torch", bucket_mb=1.0), "with DTensor tensor parallelism data parallelism is PyTorch's "
                                                     "replicate"),
    (dict(pp=2, schedule="naive", microbatches=2, impl="torch"), "no 'naive' schedule"),
    (dict(pp=4, microbatches=2, impl="torch"), "Schedule1F1B needs microbatches >= pp"),
    (dict(tp=2, impl="accelerate"), "data parallelism only"),
    (dict(tp=2, precision="bf16"), "precision=bf16 runs with single, data-parallel and scratch ZeRO"),
    (dict(master_weights=True), "choose precision bf16 or fp16"),
    (dict(bucket_mb=1.0), "bucket_mb sets the gradient buckets of plain data parallelism"),
    (dict(zero=4), "must be a ZeRO stage"),
    (dict(sequence_parallel=True), "sequence_parallel cuts tensor parallelism's replicated activations along the "
                                   "sequence; it needs tp > 1"),
    (dict(tp=4, seq_len=30, sequence_parallel=True), "seq_len=30 must divide by tp=4 under sequence parallelism"),
    (dict(cp=2, tp=4, seq_len=36, sequence_parallel=True), "seq_len / cp = 18 must divide by tp=4"),
    (dict(cp=4, seq_len=30), "seq_len=30 must divide into cp = 4 chunks of equal length"),
    (dict(cp=2, seq_len=34, zigzag=True), "seq_len=34 must divide into 2 × cp = 4 zig-zag chunks"),
    (dict(cp=3, seq_len=48, cp_algo="ulysses"), "cp must divide the 4 heads each tensor-parallel rank holds"),
    (dict(cp=2, cp_algo="spiral"), "cp_algo='spiral' is not one of ring, allgather, ulysses"),
    (dict(zigzag=True), "zigzag orders the tokens of context-parallel ranks; it needs cp > 1"),
    (dict(cp=2, dropout=0.1), "use dropout=0 with cp > 1"),
    (dict(cp=2, impl="torch", cp_algo="ulysses"), "PyTorch's context parallelism is a ring (ring or allgather)"),
    (dict(cp=2, impl="accelerate"), "context parallelism runs with impl='scratch' or 'torch'"),
    (dict(schedule="zigzag"), "is not one of naive, gpipe, 1f1b"),
    (dict(seq_len=4096), "is longer than model 'tiny'"),
    (dict(cp=0), "cp=0 must be at least 1"),
    (dict(checkpoint_activations="partial"), "checkpoint_activations='partial' is not one of none, selective, full"),
    (dict(attention="sparse"), "attention='sparse' is not one of flash, math"),
    (dict(attention="math", precision="bf16"), "attention='math' under autocast keeps its scores in whatever"),
    (dict(cp=2, checkpoint_activations="selective"), "selective recomputation with cp > 1 is not written"),
    (dict(cp=2, attention="math"), "with cp > 1 attention is context parallelism's own (ring)"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_refused_with_one_sentence(kw, says):
    with pytest.raises(ConfigError) as info:
        check(TrainConfig(**kw))
    message = str(info.value)
    assert says in message
    assert "\n" not in message and message.endswith(".")


def test_every_listed_example_is_valid():
    import shlex

    from gpucourse.parallel.catalogue import supported_table

    for row in supported_table():
        args = cli.build_parser().parse_args(shlex.split(row["example"])[1:])
        check(cli.config_from(args))


def test_estimates_accept_layouts_this_build_does_not_train():
    check(TrainConfig(tp=2, pp=2, dp=2, zero=1, microbatches=2, precision="bf16"), runnable=False)
    with pytest.raises(ConfigError):
        check(TrainConfig(tp=2, pp=2, dp=2, zero=1, microbatches=2, precision="bf16"))


@pytest.mark.parametrize("argv", [["memory", "--tp", "3"], ["plan", "--params", "7e9", "--gpus", "0"],
                                  ["batch-size", "--budget-gb", "0"], ["memory", "--params", "-5"]])
def test_memory_commands_refuse_bad_input(argv, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpucourse: error:")


def test_memory_plan_and_batch_size_commands_run(capsys, tmp_path):
    assert cli.main(["memory", "--dp", "2", "--zero", "2", "--json", str(tmp_path / "m.json")]) == 0
    assert cli.main(["plan", "--params", "7e9", "--gpus", "8", "--gpu", "a100", "--top", "3"]) == 0
    assert cli.main(["batch-size", "--dp", "2", "--budget-gb", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "largest microbatch" in out and "global batch = microbatch" in out and "layouts fit" in out
    assert (tmp_path / "m.json").exists()


def test_the_world_is_the_product_of_all_four_mesh_dimensions():
    from gpucourse.train import MESH_DIMS

    assert MESH_DIMS == ("pp", "dp", "cp", "tp")
    assert TrainConfig(pp=2, dp=3, tp=2).world_size == 12 and TrainConfig(cp=2, dp=2).world_size == 4
    assert TrainConfig().layout() == "single" and TrainConfig(dp=2, cp=2).layout() == "dp2×cp2"


def test_a_checkpoint_written_before_a_field_existed_still_matches(tmp_path):
    from gpucourse import checkpoint

    cfg = TrainConfig(dp=2)
    saved = cfg.to_dict()
    del saved["cp"]  # what a checkpoint written before the mesh had cp says
    assert checkpoint._differences(saved, cfg) == []
    assert checkpoint._differences({**saved, "lr": 0.1}, cfg) == ["lr"]
    assert checkpoint._differences({**saved, "dp": 4, "zero": 2}, cfg) == [], "the layout may change"


def test_the_list_of_what_runs_is_what_the_rules_accept():
    from gpucourse.parallel.catalogue import MESHES, supported

    rows = {(layout, impl): changes for layout, impl, _, changes in supported()}
    # Every mesh is there in scratch, and the composed ones too.
    assert {("single", "scratch"), ("dp×tp×pp", "scratch"), ("zero1×tp×pp", "scratch"), ("zero3×tp×pp", "torch"),
            ("zero3×tp×pp", "scratch"),
            ("dp×pp", "torch")} <= set(rows)
    # What the rules refuse is not listed: torch's ZeRO-1 beside tp, Accelerate with tp.
    assert not {("zero1×tp", "torch"), ("tp", "accelerate")} & set(rows)
    assert ("dp×tp", "torch") in rows and ("dp×tp×pp", "torch") in rows  # replicate: DDP for DTensor parameters
    for changes in rows.values():
        check(TrainConfig(**changes))
    assert len(MESHES) == 10 and len(rows) >= 30


def test_each_strategy_owns_its_fields_and_its_rules():
    """One record per technique, in the order parallelize applies them: every layout field is one strategy's, and
    a rule broken is refused by that strategy's own check (the config only checks what is not a strategy's)."""
    from gpucourse.config import fields_of
    from gpucourse.parallel import STRATEGIES

    owned = [f for s in STRATEGIES for f in s.fields]
    assert len(owned) == len(set(owned)) and set(fields_of("layout")) <= set(owned)
    assert [s.name for s in STRATEGIES] == ["pipeline", "tensor", "context", "experts", "recomputation", "data"]
    cases = {"context": dict(cp=2, dropout=0.1), "tensor": dict(tp=3), "experts": dict(ep=2, dp=2),
             "pipeline": dict(pp=2, microbatches=3), "recomputation": dict(attention="sparse"),
             "data": dict(bucket_mb=1.0)}
    for strategy in STRATEGIES:
        cfg = TrainConfig(**cases[strategy.name])
        with pytest.raises(ConfigError):
            for check in strategy.checks:
                check(cfg, cfg.model_config(), True)
    # What each applies is written beside it too: in its technique's own files (data parallelism's choice of
    # trainer, from DATA_PARALLEL, in the package that holds the trainers).
    homes = {s.name: {f.__module__.rsplit(".", 1)[-1] for f in s.applies + s.checks} for s in STRATEGIES}
    assert homes == {"pipeline": {"pipeline", "pipeline_virtual"},
                     "tensor": {"tensor_parallel", "tensor_parallel_torch"},
                     "context": {"context_parallel", "context_parallel_torch"}, "experts": {"expert_parallel"},
                     "recomputation": {"activation_checkpointing"}, "data": {"data_parallel", "parallel"}}


def test_a_strategy_a_run_does_not_use_leaves_the_model_as_it_was():
    """parallelize calls every strategy's apply in order; one the layout does not use returns the model untouched,
    building nothing (no group is asked for: the mesh here has no groups at all)."""
    from gpucourse.model import build_model
    from gpucourse.parallel import STRATEGIES, Built

    cfg = TrainConfig()
    model = build_model(cfg.model_config(), seed=0)
    built = Built(torch.device("cpu"), None, None)
    for strategy in STRATEGIES[:-1]:  # the last builds the trainer, on the dp group
        for apply in strategy.applies:
            assert apply(model, None, cfg, built) is model
    assert (built.gathers, built.placements, built.loop, built.extras) == ([], [], None, {})


def test_describe_names_the_trainer_parallelize_builds():
    """One choice of data-parallel trainer, read by both: context parallelism alone averages its gradients over the
    cp ranks too, so a cp-only run under PyTorch says DDP (its description once left that out)."""
    from gpucourse.parallel import DATA_PARALLEL, data_parallel_kind
    from gpucourse.parallel.catalogue import describe

    assert data_parallel_kind(TrainConfig(cp=2, impl="torch")) == "ddp"
    assert describe(TrainConfig(cp=2, impl="torch")).endswith(DATA_PARALLEL["ddp"].summary)
    assert data_parallel_kind(TrainConfig()) is None and describe(TrainConfig()) == "one device, the baseline"
    assert describe(TrainConfig(dp=2, zero=2)) == "ZeRO-2 (flat shards)"
