"""One layout in the names the production stacks use: Megatron-LM, NeMo, DeepSpeed, torchtitan and Accelerate.

``gpucourse train --dp 2 --tp 2 --pp 2 --microbatches 4 --print-config megatron`` prints the same run as
Megatron-LM command-line arguments, and trains nothing. Each tool below is one function from a
:class:`~gpucourse.config.TrainConfig` to that tool's settings, written as a plain table a learner can read
side by side with the config: the tool's name on the left of each line, gpucourse's in the comment on its
right. What a tool cannot express comes back as a *note*, one sentence each, never a silent drop::

    from gpucourse.config import TrainConfig
    from gpucourse.interop.stack_config import translate
    out = translate(TrainConfig(dp=4, zero=3, precision="bf16"), "torchtitan")
    print(out.text)      # the TOML file
    print(out.notes)     # what torchtitan does differently, or cannot do

The batch is the same everywhere: a microbatch of ``m`` sequences per forward on one data-parallel rank,
``n`` microbatches per optimizer step (grad_accum × pipeline microbatches), and the global batch
``m × n × dp`` sequences. Each tool spells those three numbers its own way.

Every name was checked in the tool's own source or documentation; the comment above each function says
which file and which version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from ..config import TrainConfig
from ..parallel import check
from ..parallel.context_parallel import ATTENTIONS
from ..parallel.schedule_table import get as get_schedule

TOOLS = ("megatron", "nemo", "deepspeed", "torchtitan", "accelerate")


@dataclass
class StackConfig:
    """One tool's version of a layout: ``settings`` (the data), ``text`` (its file or command) and ``notes``."""

    tool: str
    settings: dict
    text: str
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Nodes:
    """Where the layout's ranks run: ``count`` servers of ``gpus`` GPUs each (``count`` × ``gpus`` = the world).
    Every launcher counts GPUs per server in one field and servers in another (Accelerate alone counts every
    process of every server in ``num_processes``)."""

    count: int
    gpus: int


def nodes_for(cfg: TrainConfig, gpus_per_node: int | None = None) -> Nodes:
    """The servers ``cfg``'s world fills at ``gpus_per_node`` each (default: one server holds it all); ValueError
    with one sentence when they do not divide it."""
    world = cfg.world_size
    if gpus_per_node is None or gpus_per_node >= world:
        if gpus_per_node is not None and gpus_per_node < 1:
            raise ValueError(f"gpus_per_node {gpus_per_node} must be at least 1.")
        return Nodes(1, world)
    if gpus_per_node < 1 or world % gpus_per_node:
        raise ValueError(f"gpus_per_node {gpus_per_node} must be a positive divisor of the layout's {world} GPUs.")
    return Nodes(world // gpus_per_node, gpus_per_node)


def translate(cfg: TrainConfig, tool: str, gpus_per_node: int | None = None) -> StackConfig:
    """``cfg`` in ``tool``'s own names and format; ValueError (one sentence) for an unknown tool or a bad layout.

    The layout only has to make sense (``check(cfg, runnable=False)``): a tool may run what this build does not.
    ``gpus_per_node`` spreads the world over servers of that many GPUs (default: one server holds it all): each
    tool's own fields for servers and GPUs per server are written from it.
    """
    if tool not in TOOLS:
        raise ValueError(f"tool {tool!r} is not one of {', '.join(TOOLS)}.")
    check(cfg, runnable=False)
    nodes = nodes_for(cfg, gpus_per_node)
    settings, notes = _TRANSLATORS[tool](cfg, nodes)
    return StackConfig(tool, settings, _WRITERS[tool](cfg, settings, nodes), notes)


def torchrun(nodes: Nodes) -> list[str]:
    """The torchrun launch for ``nodes``, in parts a line each: one server, or the same command on each server
    with its rank."""
    if nodes.count == 1:
        return [f"torchrun --nproc-per-node {nodes.gpus}"]
    return [f"torchrun --nnodes {nodes.count} --nproc-per-node {nodes.gpus}",
            "--node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500"]


# --- the numbers every tool needs ------------------------------------------------------------------------

def batch(cfg: TrainConfig) -> tuple[int, int]:
    """(microbatch size in sequences, microbatches per optimizer step on one data-parallel rank)."""
    per_step = cfg.grad_accum * (cfg.microbatches if cfg.pp > 1 else 1)
    return cfg.batch_size // (cfg.dp * per_step), per_step


def chunks_per_rank(cfg: TrainConfig) -> int:
    """Model chunks each pipeline rank holds (the schedule's record says how many)."""
    return get_schedule(cfg.schedule).chunks_per_rank(cfg.virtual_stages) if cfg.pp > 1 else 1


def moe_layers(cfg: TrainConfig) -> list[int]:
    """1 for each block that holds a mixture of experts, 0 for a dense one (Megatron's --moe-layer-freq list)."""
    mc = cfg.model_config()
    return [int(mc.is_moe(i)) for i in range(mc.n_layer)]


def _accumulation_note(tool: str, cfg: TrainConfig) -> list[str]:
    _, per_step = batch(cfg)
    if cfg.pp > 1 and cfg.grad_accum > 1:
        return [f"{tool} sends all grad_accum × microbatches = {per_step} microbatches through one pipeline "
                f"schedule per step (one fill and one drain), where this layout runs the schedule grad_accum = "
                f"{cfg.grad_accum} times with {cfg.microbatches} each."]
    return []


def _even_split_note(tool: str, cfg: TrainConfig) -> list[str]:
    n_layer, stages = cfg.model_config().n_layer, cfg.pp * chunks_per_rank(cfg)
    if cfg.pp > 1 and get_schedule(cfg.schedule).megatron and n_layer % stages:
        return [f"{tool} splits the blocks evenly: num_layers = {n_layer} must divide by the {stages} pipeline "
                f"stages, where this layout lets stages differ by one block."]
    return []


def _schedule_note(tool: str, cfg: TrainConfig, offered: str) -> list[str]:
    if cfg.pp > 1 and not get_schedule(cfg.schedule).megatron:
        return [f"{tool} has no {cfg.schedule!r} pipeline schedule ({offered}): the settings above run 1F1B."]
    return []


# --- Megatron-LM ---------------------------------------------------------------------------------------------
# Checked: NVIDIA/Megatron-LM, megatron/training/arguments.py at tag core_v0.14.0 (commit 23e00ed, Oct 2025),
# the last release where every flag is spelled out in add_argument (later ones build many from dataclasses);
# megatron/core/utils.py get_batch_on_this_cp_rank (the 2·cp zig-zag split, always on);
# megatron/core/models/gpt/gpt_layer_specs.py (an integer --moe-layer-freq N puts experts in layers 0, N, 2N...);
# docs/source/api-guide/custom_fsdp.md (the Megatron FSDP flags). --cp-comm-type's help text says "allgather",
# but the value reaches Transformer Engine's attention, which only knows "all_gather" (TransformerConfig.cp_comm_type).

SHARDING = {2: "optim_grads", 3: "optim_grads_params"}  # Megatron FSDP's names for ZeRO-2 and ZeRO-3


def megatron(cfg: TrainConfig, nodes: Nodes) -> tuple[dict, list[str]]:
    """Megatron-LM ``pretrain_gpt.py`` arguments: ``{"--flag": value}``, value None for an on/off switch."""
    mc = cfg.model_config()
    micro, _ = batch(cfg)
    notes = []
    args = {
        "--num-layers": mc.n_layer,                      # n_layer
        "--hidden-size": mc.n_embd,                      # n_embd
        "--num-attention-heads": mc.n_head,              # n_head
        "--seq-length": cfg.seq_len,                     # seq_len
        "--max-position-embeddings": mc.block_size,      # block_size (learned positions, Megatron's default)
        "--hidden-dropout": cfg.dropout,                 # dropout
        "--attention-dropout": cfg.dropout,
        "--tensor-model-parallel-size": cfg.tp,          # tp
        "--pipeline-model-parallel-size": cfg.pp,        # pp
        "--context-parallel-size": cfg.cp,               # cp (dp is what is left: world / (tp × pp × cp))
        "--micro-batch-size": micro,                     # batch_size / (dp × grad_accum × microbatches)
        "--global-batch-size": cfg.batch_size,           # batch_size; Megatron derives the accumulation from it
        "--train-iters": cfg.steps,                      # steps
        "--lr": cfg.lr,                                  # lr
    }
    if cfg.sequence_parallel:
        args["--sequence-parallel"] = None               # sequence_parallel
    if cfg.pp > 1 and get_schedule(cfg.schedule).interleaved:
        args["--num-virtual-stages-per-pipeline-rank"] = cfg.virtual_stages  # virtual_stages
    if cfg.cp > 1:
        args["--cp-comm-type"] = ATTENTIONS[cfg.cp_algo].megatron  # cp_algo
        if not cfg.zigzag:
            notes.append("Megatron-LM always cuts a sequence into 2 × cp chunks, rank i holding chunks i and "
                         "2·cp−1−i (the zig-zag balance); it has no plain contiguous split.")
    if cfg.zero:
        args["--use-distributed-optimizer"] = None       # zero=1: optimizer state sharded over dp
    if cfg.zero >= 2:
        args["--use-megatron-fsdp"] = None               # zero=2 or 3: Megatron FSDP shards more
        args["--data-parallel-sharding-strategy"] = SHARDING[cfg.zero]
        args["--no-gradient-accumulation-fusion"] = None
    if cfg.precision != "fp32":
        args[f"--{cfg.precision}"] = None                # precision: --bf16 or --fp16
        if not cfg.master_weights:
            notes.append(f"Megatron-LM has no autocast mode: --{cfg.precision} keeps the weights in "
                         f"{cfg.precision} with an fp32 master copy in the optimizer, which is --master-weights "
                         f"here.")
    if cfg.precision == "fp16":                          # this course's DynamicLossScaler
        args.update({"--initial-loss-scale": 65536, "--loss-scale-window": 200, "--hysteresis": 1})
    if cfg.recompute == "full":                          # checkpoint_activations: every block recomputed
        args.update({"--recompute-granularity": "full", "--recompute-method": "uniform",
                     "--recompute-num-layers": 1})
    elif cfg.recompute == "selective":                   # attention's core recomputed
        args["--recompute-granularity"] = "selective"
    if mc.moe_experts:
        args.update({"--num-experts": mc.moe_experts,    # moe_experts
                     "--moe-router-topk": mc.moe_top_k,  # moe_top_k
                     "--moe-layer-freq": 1 if mc.moe_every == 1 else str(moe_layers(cfg)),  # moe_every
                     "--moe-aux-loss-coeff": mc.moe_aux})  # moe_aux
        if mc.moe_capacity:
            args["--moe-expert-capacity-factor"] = mc.moe_capacity  # moe_capacity (left out: no token dropped)
        args["--expert-model-parallel-size"] = cfg.ep   # ep
        if cfg.ep > 1 and cfg.precision == "fp16":
            notes.append("Megatron-LM refuses expert parallelism with --fp16 (arguments.py asserts it); use bf16.")
    notes += _schedule_note("Megatron-LM", cfg, "it offers 1F1B, interleaved with virtual stages")
    notes += _even_split_note("Megatron-LM", cfg)
    notes += _accumulation_note("Megatron-LM", cfg)
    return args, notes


def _write_megatron(cfg: TrainConfig, args: dict, nodes: Nodes) -> str:
    head = [f"# Megatron-LM (pretrain_gpt.py) for {cfg.layout()}: {_gpus(cfg, nodes)},",
            f"# data parallel = world / (tp × pp × cp) = {cfg.dp} (add your --data-path and --tokenizer-type)"]
    if nodes.count > 1:
        head.append(f"# on each of the {nodes.count} servers: NODE_RANK 0 to {nodes.count - 1}, MASTER_ADDR the "
                    f"first one's address")
    *launch, last = torchrun(nodes)
    command = [*launch, f"{last} pretrain_gpt.py"]
    command += [flag if value is None else f"{flag} {_shell_word(value)}" for flag, value in args.items()]
    return "\n".join(head) + "\n" + " \\\n    ".join(command) + "\n"


def _shell_word(value) -> str:
    text = str(value)
    return text if re.fullmatch(r"[\w.+-]+", text) else f'"{text}"'


# --- NeMo ---------------------------------------------------------------------------------------------------
# Checked: NVIDIA/NeMo at tag v2.4.0 (commit 2381f42, Jul 2025): nemo/lightning/pytorch/strategies/
# megatron_strategy.py (MegatronStrategy's arguments, fsdp="megatron"), nemo/collections/llm/recipes/llama3_8b.py
# (a recipe's trainer / data / model / optim), nemo/collections/llm/gpt/data/mock.py (micro_batch_size,
# global_batch_size, seq_length), nemo/lightning/pytorch/plugins/mixed_precision.py (precision "bf16-mixed",
# "16-mixed", "32" and the fp16 loss-scale fields), nemo/collections/llm/recipes/optim/adam.py (OptimizerConfig
# use_distributed_optimizer); model.config is Megatron-LM's TransformerConfig (core_v0.14.0,
# megatron/core/transformer/transformer_config.py) and strategy.ddp its DistributedDataParallelConfig.

NEMO_PRECISION = {"fp32": "32", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def nemo(cfg: TrainConfig, nodes: Nodes) -> tuple[dict, list[str]]:
    """A NeMo 2.0 recipe's fields (``llm.pretrain(model, data, trainer, optim)``), as nested keys."""
    mc = cfg.model_config()
    micro, _ = batch(cfg)
    notes = []
    strategy = {                                           # nemo.lightning.MegatronStrategy
        "tensor_model_parallel_size": cfg.tp,
        "pipeline_model_parallel_size": cfg.pp,
        "context_parallel_size": cfg.cp,
        "sequence_parallel": cfg.sequence_parallel,
        "expert_model_parallel_size": cfg.ep,
    }
    if cfg.pp > 1 and get_schedule(cfg.schedule).interleaved:
        strategy["virtual_pipeline_model_parallel_size"] = cfg.virtual_stages
    if cfg.zero >= 2:
        strategy["fsdp"] = "megatron"
        strategy["ddp"] = {"data_parallel_sharding_strategy": SHARDING[cfg.zero]}
    plugins = {"precision": NEMO_PRECISION[cfg.precision]}  # nemo.lightning.MegatronMixedPrecision
    if cfg.precision == "fp16":
        plugins.update(fp16_initial_loss_scale=65536, fp16_loss_scale_window=200, fp16_hysteresis=1)
    model = {"num_layers": mc.n_layer, "hidden_size": mc.n_embd, "num_attention_heads": mc.n_head,
             "seq_length": cfg.seq_len, "hidden_dropout": cfg.dropout, "attention_dropout": cfg.dropout}
    if cfg.cp > 1:
        model["cp_comm_type"] = ATTENTIONS[cfg.cp_algo].megatron
        if not cfg.zigzag:
            notes.append("NeMo (Megatron-LM underneath) always cuts a sequence into 2 × cp chunks, rank i "
                         "holding chunks i and 2·cp−1−i; it has no plain contiguous split.")
    if cfg.recompute == "full":
        model.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif cfg.recompute == "selective":
        model["recompute_granularity"] = "selective"
    if mc.moe_experts:
        model.update(num_moe_experts=mc.moe_experts, moe_router_topk=mc.moe_top_k,
                     moe_layer_freq=1 if mc.moe_every == 1 else moe_layers(cfg), moe_aux_loss_coeff=mc.moe_aux)
        if mc.moe_capacity:
            model["moe_expert_capacity_factor"] = mc.moe_capacity
    if cfg.precision != "fp32" and not cfg.master_weights:
        notes.append(f"NeMo's {NEMO_PRECISION[cfg.precision]} precision keeps {cfg.precision} weights with an "
                     f"fp32 master copy in the optimizer, which is --master-weights here, not autocast.")
    settings = {
        "trainer": {"devices": nodes.gpus, "num_nodes": nodes.count, "max_steps": cfg.steps,  # GPUs per server
                    "accumulate_grad_batches": 1,  # Megatron derives accumulation from the global batch
                    "strategy": strategy, "plugins": plugins},
        "data": {"micro_batch_size": micro, "global_batch_size": cfg.batch_size, "seq_length": cfg.seq_len},
        "model": {"config": model},
        "optim": {"config": {"lr": cfg.lr, "use_distributed_optimizer": cfg.zero > 0}},
    }
    notes += _schedule_note("NeMo", cfg, "it offers Megatron-LM's 1F1B, interleaved with virtual stages")
    notes += _even_split_note("NeMo", cfg)
    notes += _accumulation_note("NeMo", cfg)
    return settings, notes


# --- DeepSpeed ----------------------------------------------------------------------------------------------
# Checked: deepspeedai/DeepSpeed at tag v0.19.5 (commit cf44300): docs/_pages/config-json.md (batch keys, fp16,
# bf16, torch_autocast, zero_optimization.stage, activation_checkpointing, tensor_parallel.autotp_size),
# deepspeed/runtime/constants.py, deepspeed/runtime/config.py (get_pipeline_config: the "pipeline" block),
# deepspeed/runtime/pipe/engine.py (ZeRO-2/3 refused with a pipeline; activation_checkpoint_interval),
# deepspeed/__init__.py (top-level data_parallel_size + sequence_parallel_size build the Ulysses mesh),
# deepspeed/moe/layer.py (MoE(num_experts, ep_size, k, capacity_factor)). tensor_parallel first appears in
# v0.16.4, torch_autocast in v0.17.2.


def deepspeed(cfg: TrainConfig, nodes: Nodes) -> tuple[dict, list[str]]:
    """A DeepSpeed JSON config; what DeepSpeed sets in code, or does not do, goes to the notes."""
    mc = cfg.model_config()
    micro, per_step = batch(cfg)
    notes = []
    ds = {
        "train_batch_size": cfg.batch_size,              # = micro × accumulation × dp: DeepSpeed checks it
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": per_step,         # grad_accum × microbatches: a pipeline's microbatches
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr}},
        "zero_optimization": {"stage": cfg.zero},
    }
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.precision)
    if dtype and not cfg.master_weights:                 # autocast over fp32 weights
        ds["torch_autocast"] = {"enabled": True, "dtype": dtype}
        if cfg.precision == "fp16" and cfg.zero:
            notes.append("DeepSpeed's torch_autocast brings its own fp16 loss scaler (a GradScaler) only without "
                         "ZeRO; with ZeRO use its fp16 block (fp16 weights, fp32 master copy), --master-weights here.")
    elif cfg.precision == "bf16":                        # half weights, fp32 master copy in the optimizer
        ds["bf16"] = {"enabled": True}
    elif cfg.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 200,
                      "hysteresis": 1}                   # loss_scale 0: dynamic, as this course's scaler
    if cfg.tp > 1:
        ds["tensor_parallel"] = {"autotp_size": cfg.tp}
        notes.append("DeepSpeed's AutoTP finds the Linear layers to cut in Hugging Face models (preset_model or the "
                     "model's tp_plan); another model describes them in tensor_parallel.partition_config.")
    if cfg.sequence_parallel:
        notes.append("DeepSpeed has no Megatron-style sequence parallelism (LayerNorms and residuals cut along the "
                     "sequence inside tensor parallelism); its sequence parallelism is Ulysses, over cp.")
    if cfg.cp > 1 and ATTENTIONS[cfg.cp_algo].deepspeed:
        ds["data_parallel_size"] = cfg.dp
        ds["sequence_parallel_size"] = cfg.cp
        notes.append("DeepSpeed-Ulysses also needs the attention wrapped in deepspeed.sequence.layer."
                     "DistributedAttention, in the model's code.")
    elif cfg.cp > 1:
        notes.append(f"DeepSpeed has no {cfg.cp_algo} context parallelism: its only one is Ulysses (cp_algo "
                     f"ulysses, sequence_parallel_size), which exchanges heads by all-to-all.")
    if cfg.pp > 1:
        notes.append(f"DeepSpeed sets the pipeline in code, PipelineModule(layers, num_stages={cfg.pp}); its engine "
                     f"runs its own 1F1B-like schedule over the gradient_accumulation_steps microbatches.")
        if cfg.recompute == "full":
            ds["pipeline"] = {"activation_checkpoint_interval": 1}
        if cfg.zero >= 2:
            notes.append(f"DeepSpeed refuses ZeRO-{cfg.zero} with a pipeline (its pipeline engine asserts it); "
                         f"use zero 1 there.")
    elif cfg.recompute == "full":
        ds["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False,
                                          "contiguous_memory_optimization": False}
        notes.append("DeepSpeed's activation_checkpointing block only configures deepspeed.checkpointing."
                     "checkpoint; the model calls it around each block itself.")
    if cfg.recompute == "selective":
        notes.append("DeepSpeed has no selective-recomputation setting: deepspeed.checkpointing.checkpoint "
                     "recomputes whatever function the model wraps in it, so wrap attention's core there.")
    if mc.moe_experts:
        notes.append(f"DeepSpeed builds experts in code, deepspeed.moe.layer.MoE(hidden_size, expert, "
                     f"num_experts={mc.moe_experts}, ep_size={cfg.ep}, k={mc.moe_top_k}"
                     + (f", capacity_factor={mc.moe_capacity}" if mc.moe_capacity else ", drop_tokens=False")
                     + "); its JSON expert_parallel block (AutoEP) converts Hugging Face MoE models only.")
    notes += _schedule_note("DeepSpeed", cfg, "its pipeline engine has one schedule of its own")
    if cfg.pp > 1 and get_schedule(cfg.schedule).interleaved:
        notes.append("DeepSpeed's pipeline engine does not interleave: one model chunk per stage, no virtual "
                     "stages.")
    notes += _accumulation_note("DeepSpeed", cfg)
    if nodes.count > 1:
        notes.append(f"DeepSpeed's JSON holds no server count: its launcher does, as deepspeed --hostfile HOSTFILE "
                     f"--num_nodes {nodes.count} --num_gpus {nodes.gpus} train.py --deepspeed_config ds.json (the "
                     f"hostfile names each server with slots={nodes.gpus}).")
    return ds, notes


# --- torchtitan ---------------------------------------------------------------------------------------------
# Checked: pytorch/torchtitan at tag v0.2.2 (commit 73a0e69, Feb 2026), the last release configured by TOML:
# torchtitan/config/job_config.py ([training], [parallelism], [activation_checkpoint], [optimizer]),
# torchtitan/distributed/parallel_dims.py (ep carved out of dp_shard × cp × tp; cp joins the FSDP mesh),
# torchtitan/distributed/pipeline_parallel.py (layers_per_stage with the first/last-stage weights),
# torchtitan/models/llama3/infra/parallelize.py (TP always cuts norms along the sequence; DDP only alone),
# torchtitan/train.py (accumulation = global_batch_size / (local_batch_size × dp)). Schedule names: torch 2.13's
# torch/distributed/pipelining/schedules.py get_schedule_class.

ROTATE = {a.name: a.torch_rotate for a in ATTENTIONS.values() if a.torch_rotate}  # how torch moves K/V shards


def torchtitan(cfg: TrainConfig, nodes: Nodes) -> tuple[dict, list[str]]:
    """A torchtitan TOML job config: sections of keys."""
    mc = cfg.model_config()
    local = cfg.batch_size // (cfg.dp * cfg.grad_accum)  # one accumulation step's sequences on one dp rank
    notes = ["torchtitan trains its own model definitions ([model] name and flavor: llama3, deepseek_v3, ...); "
             "gpucourse's GPT is not one of them, so [model] is left out."]
    sharded = cfg.zero >= 2
    if cfg.zero == 1:
        notes.append("torchtitan has no ZeRO-1: its data parallelism replicates everything (DDP) or shards "
                     "the weights too (FSDP).")
    if not sharded and cfg.ep > 1:
        sharded = True
        notes.append("torchtitan carves expert parallelism out of sharded data-parallel ranks (dp_shard × cp × "
                     "tp), so the dp ranks are sharded here (FSDP, ZeRO-3).")
    elif not sharded and cfg.dp > 1 and cfg.cp == 1 and (cfg.tp > 1 or cfg.pp > 1):
        sharded = True
        notes.append("torchtitan runs DDP only when data parallelism is the only dimension; with tp or pp it "
                     "shards the dp ranks (FSDP, ZeRO-3), so data_parallel_shard_degree carries dp here.")
    parallelism = {
        "data_parallel_replicate_degree": 1 if sharded else cfg.dp,
        "data_parallel_shard_degree": cfg.dp if sharded else 1,
        "tensor_parallel_degree": cfg.tp,
        "pipeline_parallel_degree": cfg.pp,
        "context_parallel_degree": cfg.cp,
        "expert_parallel_degree": cfg.ep,
    }
    if sharded:                                          # ZeRO-2 keeps the gathered weights until backward
        parallelism["fsdp_reshard_after_forward"] = "never" if cfg.zero == 2 else "always"
    if cfg.ep > 1 and cfg.tp > 1:
        parallelism["expert_tensor_parallel_degree"] = cfg.tp  # experts cut by tp too, as here
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always cuts the norms along the sequence (sequence "
                     "parallelism); it has no switch to keep them whole.")
    if cfg.pp > 1:
        micro, _ = batch(cfg)
        v = chunks_per_rank(cfg)
        parallelism.update(pipeline_parallel_schedule=get_schedule(cfg.schedule).titan,
                           pipeline_parallel_microbatch_size=micro)
        if mc.n_layer % (cfg.pp * v) == 0:               # blocks per stage as here: embeddings and head weigh 0
            parallelism.update(pipeline_parallel_layers_per_stage=mc.n_layer // (cfg.pp * v),
                               pipeline_parallel_first_stage_less_layers=0,
                               pipeline_parallel_last_stage_less_layers=0)
        else:
            notes.append(f"the {mc.n_layer} blocks do not split evenly into pp × {v} stages; torchtitan splits "
                         f"them its own way.")
        record = get_schedule(cfg.schedule)
        if not record.torch_class and not record.split_backward:
            notes.append("torchtitan has no naive schedule (one microbatch at a time through every stage); GPipe "
                         "with the same microbatches is the nearest.")
        if not record.torch_class and record.split_backward:
            notes.append("torch.distributed.pipelining has no one-chunk zero-bubble schedule (ZB-H1); its "
                         "zero-bubble schedules interleave (ZBVZeroBubble, InterleavedZeroBubble): 1F1B above.")
    if cfg.cp > 1:
        if cfg.cp_algo in ROTATE:
            parallelism["context_parallel_rotate_method"] = ROTATE[cfg.cp_algo]
        else:
            notes.append("torchtitan's context parallelism moves K/V shards (allgather or alltoall); it has no "
                         "Ulysses head exchange: the settings above use its default.")
        if cfg.zigzag:
            parallelism["context_parallel_load_balancer"] = "headtail"  # chunk i and 2·cp−1−i: the zig-zag
        else:
            notes.append("torchtitan balances causal work by default (headtail, the zig-zag split); TOML has no "
                         "None to turn it off, so the plain contiguous split is not expressible here.")
        if not sharded:
            notes.append("torchtitan shards the weights over the cp ranks (its FSDP mesh is dp_shard × cp), "
                         "where this layout keeps them whole.")
    training = {"local_batch_size": local, "global_batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                "steps": cfg.steps, "mixed_precision_param": "bfloat16" if cfg.precision == "bf16" else "float32"}
    if cfg.precision == "fp16":
        notes.append("torchtitan has no fp16 (mixed_precision_param is bfloat16 or float32, with no loss "
                     "scaling): float32 above.")
    elif cfg.precision == "bf16" and not (sharded or cfg.cp > 1) and (cfg.tp > 1 or cfg.pp > 1):
        notes.append("torchtitan applies mixed_precision_param through FSDP, or autocast under DDP alone; with "
                     "tp or pp and no sharding the weights stay fp32.")
    if cfg.recompute == "selective":
        notes.append("torchtitan's selective mode checkpoints every n-th block or keeps chosen operators' outputs "
                     "(activation_checkpoint.selective_ac_option); neither recomputes just attention's core, so "
                     "the mode is left at none.")
    if mc.moe_experts:
        notes.append(f"torchtitan sets the experts ({mc.moe_experts}, top-{mc.moe_top_k}) in the model's flavor, "
                     f"in Python model arguments, not in the TOML.")
    settings = {"training": training, "parallelism": parallelism,
                "activation_checkpoint": {"mode": "full" if cfg.recompute == "full" else "none"},
                "optimizer": {"name": "AdamW", "lr": cfg.lr}}
    return settings, notes


# --- Accelerate ---------------------------------------------------------------------------------------------
# Checked: huggingface/accelerate 1.16.0 (the version this course installs): src/accelerate/commands/config/
# cluster.py (what `accelerate config` writes: fsdp_config, megatron_lm_config, deepspeed_config,
# parallelism_config keys), commands/config/config_args.py (the file's top-level fields), utils/dataclasses.py
# (DistributedType names; MegatronLMPlugin: global batch = dp × micro batch × num_micro_batches, and the
# defaults it takes when a key is missing: recompute_granularity "full", context_parallel_size 2),
# parallelism_config.py (context parallelism needs FSDP2 and sharded dp ranks), utils/launch.py (which
# megatron_lm_* and parallelism_config_* keys reach the plugin).


def accelerate(cfg: TrainConfig, nodes: Nodes) -> tuple[dict, list[str]]:
    """An ``accelerate config`` YAML file: the launcher's settings; the batch stays in the script."""
    micro, per_step = batch(cfg)
    notes = []
    # num_processes counts every process of every machine; machine_rank is each machine's own (0 on the first).
    conf = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": nodes.count,
            "machine_rank": 0, "num_processes": cfg.world_size,
            "mixed_precision": "no" if cfg.precision == "fp32" else cfg.precision, "main_training_function": "main"}
    if cfg.tp > 1 or cfg.pp > 1:
        conf["distributed_type"] = "MEGATRON_LM"
        mlm = conf["megatron_lm_config"] = {
            "megatron_lm_tp_degree": cfg.tp, "megatron_lm_pp_degree": cfg.pp,
            "megatron_lm_context_parallel_size": cfg.cp,  # written even at 1: the plugin's default when unset is 2
            "megatron_lm_num_micro_batches": per_step,  # global batch = dp × micro batch × num_micro_batches
            "megatron_lm_sequence_parallelism": cfg.sequence_parallel,
            "megatron_lm_use_distributed_optimizer": cfg.zero > 0,
            "megatron_lm_attention_dropout": cfg.dropout, "megatron_lm_hidden_dropout": cfg.dropout}
        if cfg.recompute == "full":
            mlm.update(megatron_lm_recompute_granularity="full", megatron_lm_recompute_method="uniform",
                       megatron_lm_recompute_num_layers=1)
        elif cfg.recompute == "selective":
            mlm["megatron_lm_recompute_activations"] = True  # the plugin's switch for selective recomputation
        else:
            notes.append("Accelerate's Megatron-LM plugin sets recompute_granularity to full when it is not given, "
                         "so every block is recomputed; its config file cannot leave recomputation off.")
        if cfg.ep > 1:
            mlm.update(megatron_lm_expert_model_parallel_size=cfg.ep, megatron_lm_expert_tensor_parallel_size=cfg.tp)
            notes.append("Accelerate's Megatron-LM plugin takes the experts themselves (how many, top-k) from the "
                         "model it wraps, not from this file.")
        if cfg.zero >= 2:
            notes.append(f"Accelerate's config file sets the Megatron-LM plugin's distributed optimizer (optimizer "
                         f"state sharded), not ZeRO-{cfg.zero}'s sharding of gradients and weights.")
        if cfg.cp > 1 and cfg.cp_algo != "ring":
            notes.append(f"Accelerate's Megatron-LM plugin has no key for Megatron-LM's cp_comm_type, so its default "
                         f"ring (p2p) runs, not {cfg.cp_algo}.")
        if cfg.cp > 1 and not cfg.zigzag:
            notes.append("Megatron-LM, under Accelerate too, always cuts a sequence into 2 × cp chunks (the zig-zag "
                         "balance); it has no plain contiguous split.")
        notes += _schedule_note("Accelerate's Megatron-LM plugin", cfg, "it runs Megatron-LM's 1F1B")
        if cfg.pp > 1 and get_schedule(cfg.schedule).interleaved:
            notes.append("Accelerate's config file has no key for virtual pipeline stages: plain 1F1B.")
        notes += _accumulation_note("Accelerate's Megatron-LM plugin", cfg)
    elif cfg.zero >= 2 or cfg.cp > 1:
        conf["distributed_type"] = "FSDP"
        conf["fsdp_config"] = {"fsdp_version": 2, "fsdp_reshard_after_forward": cfg.zero != 2,
                               "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                               "fsdp_transformer_layer_cls_to_wrap": "Block",
                               "fsdp_activation_checkpointing": cfg.recompute == "full"}
        if cfg.cp > 1:
            conf["parallelism_config"] = {"parallelism_config_dp_replicate_size": 1,
                                          "parallelism_config_dp_shard_size": cfg.dp,
                                          "parallelism_config_cp_size": cfg.cp}
            if cfg.cp_algo in ROTATE:
                conf["parallelism_config"]["parallelism_config_cp_comm_strategy"] = ROTATE[cfg.cp_algo]
            else:
                notes.append("Accelerate's context parallelism moves K/V shards (allgather or alltoall); Ulysses "
                             "is its DeepSpeed sequence parallelism (sp_size), not written here.")
            if cfg.zero < 2:
                notes.append("Accelerate runs context parallelism on FSDP2 only, so the weights are sharded over "
                             "dp × cp, where this layout keeps them whole.")
    elif cfg.zero == 1:
        conf["distributed_type"] = "DEEPSPEED"          # Accelerate offers ZeRO-1 through DeepSpeed
        conf["deepspeed_config"] = {"zero_stage": 1, "gradient_accumulation_steps": per_step}
    elif cfg.world_size == 1:
        conf["distributed_type"] = "NO"
    if cfg.recompute == "selective" and conf["distributed_type"] != "MEGATRON_LM":
        notes.append("Accelerate offers selective recomputation only through its Megatron-LM plugin: elsewhere wrap "
                     "attention's core in torch.utils.checkpoint in the script.")
    if cfg.recompute == "full" and conf["distributed_type"] in ("MULTI_GPU", "DEEPSPEED", "NO"):
        notes.append("Accelerate's config file has no activation-checkpointing switch here: wrap each block in "
                     "torch.utils.checkpoint (or call the model's gradient_checkpointing_enable()) in the script.")
    if cfg.ep > 1 and conf["distributed_type"] != "MEGATRON_LM":
        notes.append("Accelerate has no expert parallelism outside its Megatron-LM plugin: the experts stay "
                     "replicated on every rank.")
    if cfg.sequence_parallel and conf["distributed_type"] != "MEGATRON_LM":
        notes.append("Accelerate offers Megatron-style sequence parallelism only through its Megatron-LM plugin.")
    plugin = conf["distributed_type"] in ("DEEPSPEED", "MEGATRON_LM")
    if cfg.precision != "fp32" and cfg.master_weights and conf["distributed_type"] in ("MULTI_GPU", "NO"):
        notes.append("Accelerate's mixed_precision under DDP is autocast over fp32 weights; half weights with an "
                     "fp32 master copy (--master-weights) come from its DeepSpeed or Megatron-LM plugins.")
    elif cfg.precision != "fp32" and not cfg.master_weights and plugin:
        notes.append(f"Accelerate hands mixed_precision to {conf['distributed_type']}, which keeps half weights "
                     f"with an fp32 master copy (--master-weights here), not autocast.")
    if conf["distributed_type"] != "MEGATRON_LM":
        notes.append(f"Accelerate's config file holds no batch: the script's DataLoader gives {micro} sequences "
                     f"per process and Accelerator(gradient_accumulation_steps={per_step}) accumulates, for a "
                     f"global batch of {micro} × {per_step} × {cfg.dp} = {cfg.batch_size}.")
    if nodes.count > 1:
        conf.update(main_process_ip="MAIN_MACHINE_ADDRESS", main_process_port=29500, same_network=True)
        notes.append(f"Accelerate reads one such file on each of the {nodes.count} machines: machine_rank 0 on the "
                     f"first, 1 to {nodes.count - 1} on the others, main_process_ip the first one's address.")
    return conf, notes


# --- writing each format -------------------------------------------------------------------------------------

def _scalar(value, toml: bool = False) -> str:
    """One value as YAML or TOML writes it (both read JSON's strings, numbers and lists)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str) and not toml and re.fullmatch(r"[A-Za-z_][\w.+-]*", value) \
            and value.lower() not in ("true", "false", "yes", "no", "on", "off", "null", "y", "n"):
        return value
    return json.dumps(value)


def _yaml(data: dict, indent: int = 0) -> list[str]:
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines += [f"{' ' * indent}{key}:", *_yaml(value, indent + 2)]
        else:
            lines.append(f"{' ' * indent}{key}: {_scalar(value)}")
    return lines


def _gpus(cfg: TrainConfig, nodes: Nodes) -> str:
    """``8 GPUs``, or ``64 GPUs on 8 servers of 8``."""
    return f"{cfg.world_size} GPU{'s' * (cfg.world_size > 1)}" + (
        f" on {nodes.count} servers of {nodes.gpus}" if nodes.count > 1 else "")


def _comments(cfg: TrainConfig, tool: str, nodes: Nodes) -> list[str]:
    micro, per_step = batch(cfg)
    return [f"# {tool} settings for {cfg.layout()} ({_gpus(cfg, nodes)}), written by gpucourse train --print-config",
            f"# global batch {cfg.batch_size} = microbatch {micro} × {per_step} per step × dp {cfg.dp}"]


def _write_yaml(tool: str):
    return lambda cfg, data, nodes: "\n".join(_comments(cfg, tool, nodes) + _yaml(data)) + "\n"


def _write_toml(cfg: TrainConfig, data: dict, nodes: Nodes) -> str:
    # torchtitan's job file holds no server count: its launcher, torchrun, does.
    *launch, last = torchrun(nodes)
    lines = _comments(cfg, "torchtitan", nodes) + [f"# launch: {launch[0]}" if launch else f"# launch: {last}"] \
        + [f"#     {part}" for part in (launch[1:] + [last] if launch else [])] \
        + ["#     -m torchtitan.train --job.config_file <this file>"]
    for section, table in data.items():
        lines += ["", f"[{section}]", *(f"{key} = {_scalar(value, toml=True)}" for key, value in table.items())]
    return "\n".join(lines) + "\n"


def _write_json(cfg: TrainConfig, data: dict, nodes: Nodes) -> str:
    return json.dumps(data, indent=2) + "\n"  # JSON has no comments: the notes go to stderr


_TRANSLATORS = {"megatron": megatron, "nemo": nemo, "deepspeed": deepspeed, "torchtitan": torchtitan,
                "accelerate": accelerate}
_WRITERS = {"megatron": _write_megatron, "nemo": _write_yaml("NeMo"), "deepspeed": _write_json,
            "torchtitan": _write_toml, "accelerate": _write_yaml("Accelerate")}
