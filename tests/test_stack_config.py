"""`gpucourse train --print-config TOOL`: a layout in Megatron-LM's, NeMo's, DeepSpeed's, torchtitan's and
Accelerate's own names. Every name printed is one of the tool's own (the lists below cite where each was read),
every file parses, the batch adds up, and what a tool cannot express is said in a sentence. No rank starts."""

from __future__ import annotations

import json
import shlex
import tomllib

import pytest

import gpucourse.train
from gpucourse import cli
from gpucourse.config import ConfigError, TrainConfig
from gpucourse.interop.stack_config import TOOLS, batch, translate

# Megatron-LM, megatron/training/arguments.py at tag core_v0.14.0 (each an add_argument there).
MEGATRON_FLAGS = {
    "--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--max-position-embeddings",
    "--hidden-dropout", "--attention-dropout", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--context-parallel-size", "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr",
    "--sequence-parallel", "--num-virtual-stages-per-pipeline-rank", "--cp-comm-type", "--use-distributed-optimizer",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--no-gradient-accumulation-fusion", "--bf16",
    "--fp16", "--initial-loss-scale", "--loss-scale-window", "--hysteresis", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--num-experts", "--moe-router-topk", "--moe-layer-freq",
    "--moe-aux-loss-coeff", "--moe-expert-capacity-factor", "--expert-model-parallel-size",
}
MEGATRON_SWITCHES = {"--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp",
                     "--no-gradient-accumulation-fusion", "--bf16", "--fp16"}  # action='store_true' / 'store_false'
MEGATRON_CHOICES = {"--recompute-granularity": {"full", "selective"}, "--recompute-method": {"uniform", "block"},
                    "--data-parallel-sharding-strategy": {"no_shard", "optim", "optim_grads", "optim_grads_params"},
                    # Transformer Engine's DotProductAttention(cp_comm_type=...), through TransformerConfig.cp_comm_type
                    "--cp-comm-type": {"p2p", "all_gather", "a2a", "a2a+p2p"}}

# NeMo v2.4.0: MegatronStrategy.__init__ (nemo/lightning/pytorch/strategies/megatron_strategy.py), nl.Trainer as
# the llama3_8b recipe builds it, MockDataModule.__init__ (nemo/collections/llm/gpt/data/mock.py),
# MegatronMixedPrecision.__init__ (nemo/lightning/pytorch/plugins/mixed_precision.py); model.config is Megatron
# core_v0.14.0's TransformerConfig (megatron/core/transformer/transformer_config.py), optim.config its
# OptimizerConfig, strategy.ddp its DistributedDataParallelConfig.
NEMO_KEYS = {
    "trainer.devices", "trainer.num_nodes", "trainer.max_steps", "trainer.accumulate_grad_batches",
    *(f"trainer.strategy.{k}" for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                        "virtual_pipeline_model_parallel_size", "context_parallel_size",
                                        "sequence_parallel", "expert_model_parallel_size", "fsdp",
                                        "ddp.data_parallel_sharding_strategy")),
    *(f"trainer.plugins.{k}" for k in ("precision", "fp16_initial_loss_scale", "fp16_loss_scale_window",
                                       "fp16_hysteresis")),
    "data.micro_batch_size", "data.global_batch_size", "data.seq_length",
    *(f"model.config.{k}" for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                                    "hidden_dropout", "attention_dropout", "cp_comm_type", "recompute_granularity",
                                    "recompute_method", "recompute_num_layers", "num_moe_experts", "moe_router_topk",
                                    "moe_layer_freq", "moe_aux_loss_coeff", "moe_expert_capacity_factor")),
    "optim.config.lr", "optim.config.use_distributed_optimizer",
}
NEMO_PRECISIONS = {"16-mixed", "bf16-mixed", "32"}  # MegatronMixedPrecision's precision Literal

# DeepSpeed v0.19.5: docs/_pages/config-json.md and deepspeed/runtime/constants.py; "pipeline" from
# deepspeed/runtime/config.py get_pipeline_config; data_parallel_size / sequence_parallel_size from
# deepspeed/__init__.py (the Ulysses mesh).
DEEPSPEED_KEYS = {
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer.type",
    "optimizer.params.lr", "zero_optimization.stage", "torch_autocast.enabled", "torch_autocast.dtype",
    "bf16.enabled", "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window",
    "fp16.hysteresis", "tensor_parallel.autotp_size", "pipeline.activation_checkpoint_interval",
    "activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing",
    "activation_checkpointing.contiguous_memory_optimization", "data_parallel_size", "sequence_parallel_size",
}

# torchtitan v0.2.2: torchtitan/config/job_config.py, the dataclasses Training, Parallelism, ActivationCheckpoint,
# Optimizer (a TOML section each).
TORCHTITAN_KEYS = {
    *(f"training.{k}" for k in ("local_batch_size", "global_batch_size", "seq_len", "steps",
                                "mixed_precision_param")),
    *(f"parallelism.{k}" for k in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                                   "fsdp_reshard_after_forward", "tensor_parallel_degree", "pipeline_parallel_degree",
                                   "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                                   "pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
                                   "pipeline_parallel_last_stage_less_layers", "context_parallel_degree",
                                   "context_parallel_rotate_method", "context_parallel_load_balancer",
                                   "expert_parallel_degree", "expert_tensor_parallel_degree")),
    "activation_checkpoint.mode", "optimizer.name", "optimizer.lr",
}
# torchtitan passes pipeline_parallel_schedule to torch's get_schedule_class (torch 2.13,
# torch/distributed/pipelining/schedules.py); importing that module here would cost seconds.
TORCH_SCHEDULES = {"1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "PipelineScheduleSingle",
                   "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV"}
TORCHTITAN_CHOICES = {"parallelism.fsdp_reshard_after_forward": {"default", "always", "never"},
                      "parallelism.context_parallel_rotate_method": {"allgather", "alltoall"},
                      "parallelism.context_parallel_load_balancer": {"headtail", "ptrr"},
                      "activation_checkpoint.mode": {"selective", "full", "memory_budget", "none"},
                      "training.mixed_precision_param": {"bfloat16", "float32"}}

# Accelerate: the installed package itself (1.16.0) is the list — see test_accelerate_names_are_accelerates_own.

LAYOUTS = {
    "dp": dict(dp=4),
    "dp-tp-pp-interleaved": dict(model="medium", dp=2, tp=2, pp=2, microbatches=4, schedule="interleaved-1f1b",
                                 virtual_stages=2, sequence_parallel=True, batch_size=16),
    "pp-grad-accum": dict(pp=2, microbatches=2, grad_accum=2, batch_size=8),
    "cp-ring": dict(dp=2, cp=2, cp_algo="ring", zigzag=True),
    "cp-ulysses": dict(cp=2, cp_algo="ulysses"),
    "moe-ep": dict(dp=4, ep=2, moe_experts=4, moe_top_k=2, moe_every=2, moe_capacity=1.25, zero=1),
    "zero1": dict(dp=2, zero=1),
    "zero2": dict(dp=4, zero=2),
    "zero3-bf16": dict(dp=2, zero=3, precision="bf16"),
    "bf16-master": dict(dp=2, precision="bf16", master_weights=True),
    "fp16": dict(dp=2, precision="fp16"),
    "checkpointing": dict(dp=2, checkpoint_activations=True),
    "selective": dict(dp=2, checkpoint_activations="selective"),
    "selective-tp-pp": dict(model="medium", tp=2, pp=2, microbatches=4, batch_size=16,
                            checkpoint_activations="selective"),
    "single": dict(),
}
CASES = [(tool, name) for tool in TOOLS for name in LAYOUTS]


def config(name: str) -> TrainConfig:
    return TrainConfig(**LAYOUTS[name])


def keys(data: dict, prefix: str = "") -> set[str]:
    """Dotted paths to every leaf of nested dicts."""
    out = set()
    for k, v in data.items():
        out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def megatron_args(text: str) -> dict:
    """The flags of the printed command line, parsed as a shell would: {flag: value or None}."""
    command = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    words = shlex.split(command.replace("\\\n", " "))  # a backslash at the end of a line continues it
    assert words[:3] == ["torchrun", "--nproc-per-node", words[2]] and words[3] == "pretrain_gpt.py"
    args, words = {}, words[4:]
    while words:
        flag = words.pop(0)
        assert flag.startswith("--") and flag not in args, flag
        args[flag] = None if flag in MEGATRON_SWITCHES else words.pop(0)
    return args


def parsed(tool: str, text: str) -> dict:
    """The printed file read back with the format's own parser."""
    if tool == "megatron":
        return megatron_args(text)
    if tool == "deepspeed":
        return json.loads(text)
    if tool == "torchtitan":
        return tomllib.loads(text)
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(text)


@pytest.mark.parametrize("tool, name", CASES, ids=[f"{t}-{n}" for t, n in CASES])
def test_every_printed_name_is_the_tools_own_and_the_file_parses(tool, name):
    out = translate(config(name), tool)
    data = parsed(tool, out.text)
    if tool == "megatron":
        assert set(data) <= MEGATRON_FLAGS, set(data) - MEGATRON_FLAGS
        assert data == {k: None if v is None else str(v) for k, v in out.settings.items()}
        for flag, allowed in MEGATRON_CHOICES.items():
            assert data.get(flag, next(iter(allowed))) in allowed, (flag, data[flag])
    elif tool == "nemo":
        assert keys(data) <= NEMO_KEYS, keys(data) - NEMO_KEYS
        assert data["trainer"]["plugins"]["precision"] in NEMO_PRECISIONS
    elif tool == "deepspeed":
        assert keys(data) <= DEEPSPEED_KEYS, keys(data) - DEEPSPEED_KEYS
    elif tool == "torchtitan":
        assert keys(data) <= TORCHTITAN_KEYS, keys(data) - TORCHTITAN_KEYS
        flat = {f"{section}.{k}": v for section, table in data.items() for k, v in table.items()}
        for key, allowed in TORCHTITAN_CHOICES.items():
            assert key not in flat or flat[key] in allowed, (key, flat[key])
    if tool != "megatron":
        assert data == out.settings  # what was written is what was meant
    assert all(isinstance(n, str) and n.endswith(".") and "\n" not in n for n in out.notes), out.notes


def test_accelerate_names_are_accelerates_own(tmp_path):
    """Accelerate is installed with the course: its own config class reads the file, and every nested key is one of
    `accelerate launch`'s options (a config file's keys become those options)."""
    pytest.importorskip("yaml")
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils import DistributedType

    options = {a.dest for a in launch_command_parser()._actions}
    for name in LAYOUTS:
        out = translate(config(name), "accelerate")
        path = tmp_path / f"{name}.yaml"
        path.write_text(out.text)
        cluster = ClusterConfig.from_yaml_file(str(path))  # unknown top-level fields raise here
        assert cluster.distributed_type in set(DistributedType)
        nested = {k for v in out.settings.values() if isinstance(v, dict) for k in v}
        assert nested <= options, nested - options
        assert out.settings["mixed_precision"] in ("no", "fp16", "bf16")


def test_torchtitan_schedules_are_torchs():
    from gpucourse.parallel.schedule_table import SCHEDULES

    for schedule in [name for name in SCHEDULES if name != "dualpipev"]:  # DualPipeV needs m ≥ 2·pp
        cfg = TrainConfig(pp=2, microbatches=2, schedule=schedule, batch_size=4)
        assert translate(cfg, "torchtitan").settings["parallelism"]["pipeline_parallel_schedule"] in TORCH_SCHEDULES


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_batch_adds_up_in_every_tool(name):
    cfg = config(name)
    micro, per_step = batch(cfg)
    assert micro * per_step * cfg.dp == cfg.batch_size
    meg = translate(cfg, "megatron").settings
    assert int(meg["--global-batch-size"]) == cfg.batch_size and int(meg["--micro-batch-size"]) == micro
    assert meg["--tensor-model-parallel-size"] * meg["--pipeline-model-parallel-size"] \
        * meg["--context-parallel-size"] * cfg.dp == cfg.world_size  # Megatron's dp is what is left
    data = translate(cfg, "nemo").settings["data"]
    assert (data["micro_batch_size"], data["global_batch_size"]) == (micro, cfg.batch_size)
    ds = translate(cfg, "deepspeed").settings
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * cfg.dp
    titan = translate(cfg, "torchtitan").settings
    p, t = titan["parallelism"], titan["training"]
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    assert dp == cfg.dp and dp * p["tensor_parallel_degree"] * p["pipeline_parallel_degree"] \
        * p["context_parallel_degree"] == cfg.world_size
    assert t["global_batch_size"] % (t["local_batch_size"] * dp) == 0  # torchtitan's accumulation steps
    assert t["global_batch_size"] // (t["local_batch_size"] * dp) == cfg.grad_accum
    if cfg.pp > 1:
        assert t["local_batch_size"] == p["pipeline_parallel_microbatch_size"] * cfg.microbatches
    acc = translate(cfg, "accelerate").settings
    assert acc["num_processes"] == cfg.world_size
    if "megatron_lm_config" in acc:  # Accelerate: global batch = dp × micro batch × num_micro_batches
        assert cfg.dp * micro * acc["megatron_lm_config"]["megatron_lm_num_micro_batches"] == cfg.batch_size


def test_each_setting_lands_where_the_tool_keeps_it():
    cfg = config("dp-tp-pp-interleaved")
    meg = translate(cfg, "megatron").settings
    assert (meg["--tensor-model-parallel-size"], meg["--pipeline-model-parallel-size"]) == (2, 2)
    assert meg["--num-virtual-stages-per-pipeline-rank"] == 2 and "--sequence-parallel" in meg
    strategy = translate(cfg, "nemo").settings["trainer"]["strategy"]
    assert strategy["virtual_pipeline_model_parallel_size"] == 2 and strategy["sequence_parallel"] is True
    titan = translate(cfg, "torchtitan").settings["parallelism"]
    assert titan["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert titan["pipeline_parallel_layers_per_stage"] == cfg.model_config().n_layer // (2 * 2)

    moe = translate(config("moe-ep"), "megatron").settings
    assert (moe["--num-experts"], moe["--moe-router-topk"], moe["--expert-model-parallel-size"]) == (4, 2, 2)
    assert moe["--moe-layer-freq"] == "[0, 1, 0, 1]" and moe["--moe-expert-capacity-factor"] == 1.25
    assert eval(moe["--moe-layer-freq"]) == [int(config("moe-ep").model_config().is_moe(i)) for i in range(4)]
    assert translate(config("moe-ep"), "torchtitan").settings["parallelism"]["expert_parallel_degree"] == 2

    cp = translate(config("cp-ring"), "megatron").settings
    assert (cp["--context-parallel-size"], cp["--cp-comm-type"]) == (2, "p2p")
    assert translate(config("cp-ulysses"), "deepspeed").settings["sequence_parallel_size"] == 2
    assert translate(config("cp-ring"), "torchtitan").settings["parallelism"]["context_parallel_rotate_method"] \
        == "alltoall"

    for stage in (0, 1, 2, 3):
        cfg = TrainConfig(dp=2, zero=stage)
        assert translate(cfg, "deepspeed").settings["zero_optimization"]["stage"] == stage
        meg = translate(cfg, "megatron").settings
        assert ("--use-distributed-optimizer" in meg) == (stage > 0)
        assert meg.get("--data-parallel-sharding-strategy") == {2: "optim_grads", 3: "optim_grads_params"}.get(stage)
        titan = translate(cfg, "torchtitan").settings["parallelism"]
        assert (titan["data_parallel_shard_degree"] > 1) == (stage >= 2)
    assert translate(TrainConfig(dp=2, zero=2), "accelerate").settings["fsdp_config"]["fsdp_reshard_after_forward"] \
        is False
    assert translate(TrainConfig(dp=2, zero=3), "accelerate").settings["fsdp_config"]["fsdp_reshard_after_forward"]

    assert translate(config("zero3-bf16"), "torchtitan").settings["training"]["mixed_precision_param"] == "bfloat16"
    assert translate(config("bf16-master"), "deepspeed").settings["bf16"] == {"enabled": True}
    assert translate(config("zero3-bf16"), "deepspeed").settings["torch_autocast"]["dtype"] == "bfloat16"
    assert "--bf16" in translate(config("bf16-master"), "megatron").settings
    ckpt = translate(config("checkpointing"), "megatron").settings
    assert (ckpt["--recompute-granularity"], ckpt["--recompute-method"], ckpt["--recompute-num-layers"]) \
        == ("full", "uniform", 1)
    assert translate(config("checkpointing"), "torchtitan").settings["activation_checkpoint"]["mode"] == "full"
    assert translate(config("selective"), "megatron").settings["--recompute-granularity"] == "selective"
    assert "--recompute-method" not in translate(config("selective"), "megatron").settings
    assert translate(config("selective"), "nemo").settings["model"]["config"]["recompute_granularity"] == "selective"
    assert translate(config("selective-tp-pp"), "accelerate").settings["megatron_lm_config"][
        "megatron_lm_recompute_activations"] is True
    assert translate(config("selective"), "torchtitan").settings["activation_checkpoint"]["mode"] == "none"


def test_what_a_tool_cannot_express_is_said_not_dropped():
    def notes(name_or_cfg, tool):
        cfg = name_or_cfg if isinstance(name_or_cfg, TrainConfig) else config(name_or_cfg)
        return " ".join(translate(cfg, tool).notes)

    assert "Ulysses" in notes("cp-ring", "deepspeed")                      # DeepSpeed's only CP
    assert "autocast" in notes("zero3-bf16", "megatron")                   # Megatron's bf16 keeps master weights
    assert "no fp16" in notes("fp16", "torchtitan")
    assert "no ZeRO-1" in notes("zero1", "torchtitan")
    assert "expert parallelism" in notes("moe-ep", "accelerate")
    assert "'gpipe'" in notes(TrainConfig(pp=2, microbatches=2, schedule="gpipe", batch_size=4), "megatron")
    assert "one pipeline schedule per step" in notes("pp-grad-accum", "megatron")
    assert "contiguous split" in notes(TrainConfig(cp=2), "megatron")
    assert "PipelineModule" in notes("pp-grad-accum", "deepspeed")
    assert "divide" in notes(TrainConfig(model="small", pp=4, microbatches=4, batch_size=8), "megatron")
    for tool in ("deepspeed", "torchtitan", "accelerate"):                 # no switch for attention's core alone
        assert "attention's core" in notes("selective", tool)
    assert "attention's core" not in notes("selective-tp-pp", "accelerate")  # its Megatron-LM plugin has one
    assert notes("dp", "megatron") == "" and notes("dp", "deepspeed") == ""  # plain data parallelism: nothing lost


def test_print_config_starts_no_rank_and_keeps_stdout_a_file(capsys, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(gpucourse.train, "run", no_run)
    assert cli.main(["train", "--dp", "2", "--zero", "3", "--precision", "bf16", "--print-config", "deepspeed"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["zero_optimization"] == {"stage": 3}
    assert err == ""
    assert cli.main(["train", "--dp", "2", "--cp", "2", "--print-config", "deepspeed"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)
    assert err.startswith("note: DeepSpeed has no ring context parallelism") and err.count("\n") == 1
    assert cli.main(["train", "--pp", "2", "--microbatches", "2", "--print-config", "torchtitan"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["parallelism"]["pipeline_parallel_degree"] == 2


@pytest.mark.parametrize("argv, words", [
    (["--print-config", "jax"], "--print-config 'jax' is not one of megatron, nemo"),
    (["--tp", "3", "--print-config", "megatron"], "tp=3 must divide n_head=4"),
])
def test_bad_input_is_one_sentence(argv, words, capsys):
    assert cli.main(["train", *argv]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith("gpucourse: error: ") and words in line
    with pytest.raises((ValueError, ConfigError)):
        translate(TrainConfig(tp=3), "megatron")


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_every_tool_places_the_layout_on_its_servers(nodes):
    """Each tool's fields for servers and GPUs per server, as its documentation defines them: torchrun's (Megatron-LM,
    torchtitan) --nnodes and --nproc-per-node count servers and processes per server; NeMo's trainer counts devices
    per node and num_nodes; Accelerate's num_processes counts every process of every machine, num_machines the
    machines; DeepSpeed's launcher takes --num_nodes and --num_gpus (per node), which its JSON cannot hold."""
    cfg = TrainConfig(dp=8, tp=4, pp=2, microbatches=8, batch_size=64)  # 64 GPUs
    per_node = 64 // nodes
    out = {tool: translate(cfg, tool, gpus_per_node=per_node) for tool in TOOLS}
    command = "\n".join(line for line in out["megatron"].text.splitlines() if not line.startswith("#"))
    launch = shlex.split(command.replace("\\\n", " ").split(" pretrain_gpt.py")[0])
    expected = ["torchrun", "--nproc-per-node", str(per_node)] if nodes == 1 else \
        ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--node-rank", "$NODE_RANK",
         "--master-addr", "$MASTER_ADDR", "--master-port", "29500"]
    assert launch == expected, launch
    titan = " ".join(line.lstrip("#").strip().removeprefix("launch: ") for line in out["torchtitan"].text.splitlines()
                     if line.startswith("#"))
    assert " ".join(expected) + " -m torchtitan.train" in titan, titan
    trainer = out["nemo"].settings["trainer"]
    assert (trainer["devices"], trainer["num_nodes"]) == (per_node, nodes)
    acc = out["accelerate"].settings
    assert (acc["num_processes"], acc["num_machines"], acc["machine_rank"]) == (64, nodes, 0)
    assert ("main_process_ip" in acc) == (nodes > 1)
    ds = [n for n in out["deepspeed"].notes if "--num_nodes" in n]
    assert ds == ([] if nodes == 1 else [n for n in ds if f"--num_nodes {nodes} --num_gpus {per_node}" in n]), ds
    assert len(ds) == (nodes > 1)


def test_servers_that_do_not_divide_the_layout_are_refused(capsys):
    with pytest.raises(ValueError, match="gpus_per_node 3 must be a positive divisor of the layout's 8 GPUs"):
        translate(TrainConfig(dp=8), "nemo", gpus_per_node=3)
    assert cli.main(["train", "--dp", "8", "--print-config", "nemo", "--gpus-per-node", "3"]) != 0
    assert "--gpus-per-node 3 must be a positive divisor" in capsys.readouterr().err
    assert cli.main(["train", "--dp", "2", "--gpus-per-node", "2"]) != 0
    assert "--gpus-per-node places a layout's ranks on servers for --print-config" in capsys.readouterr().err
