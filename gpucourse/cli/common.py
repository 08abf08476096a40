"""What every command group shares: one sentence for bad input, output paths checked before anything runs, and
the layout flags that describe a TrainConfig."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from ..config import TrainConfig
from ..files import write_atomic
from ..parallel.context_parallel import ATTENTIONS
from ..parallel.schedule_table import SCHEDULES


class UsageError(Exception):
    """Bad command-line input; the message is one sentence."""


def check_writable(path: str, flag: str) -> None:
    """Refuse an output path we could not write, before anything runs."""
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give a file name.")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path} cannot be written: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path} cannot be written: permission denied.")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="model size: tiny, small, medium, gpt2-small, gpt2-medium")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree")
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=d.pp, help="pipeline-parallel degree (stages)")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel degree: seq_len / cp tokens per rank")
    p.add_argument("--cp-algo", default=d.cp_algo, help="context-parallel attention: " + "; ".join(
        f"{name} ({a.summary})" for name, a in ATTENTIONS.items()))
    p.add_argument("--zigzag", action="store_true",
                   help="context parallel: 2·cp chunks, rank i holding i and 2·cp-1-i (causal load balance)")
    p.add_argument("--moe-experts", type=int, default=d.moe_experts,
                   help="mixture of experts: E expert MLPs in place of each MoE block's MLP (0: dense)")
    p.add_argument("--moe-top-k", type=int, default=d.moe_top_k, help="mixture of experts: experts per token (2)")
    p.add_argument("--moe-every", type=int, default=d.moe_every,
                   help="mixture of experts in every block (1) or every n-th block (n)")
    p.add_argument("--moe-capacity", type=float, default=d.moe_capacity,
                   help="capacity factor: an expert takes at most c·tokens·top_k/E choices (default: no dropping)")
    p.add_argument("--moe-aux", type=float, default=d.moe_aux, help="weight of the load-balancing loss (0.01)")
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel degree: experts spread over ep dp ranks")
    p.add_argument("--zero", type=int, default=d.zero, help="ZeRO stage 0-3")
    p.add_argument("--schedule", default=None,
                   help=f"pipeline schedule (with --pp > 1; default {d.schedule}): {', '.join(SCHEDULES)}")
    p.add_argument("--virtual-stages", type=int, default=d.virtual_stages,
                   help="interleaved-1f1b: model chunks per pipeline rank")
    p.add_argument("--microbatches", type=int, default=d.microbatches, help="pipeline microbatches per step")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="gradient-accumulation microbatches")
    p.add_argument("--precision", default=d.precision, help="fp32, bf16 or fp16 (autocast unless --master-weights)")
    p.add_argument("--master-weights", action="store_true",
                   help="half-precision weights and gradients, fp32 master copy in the optimizer")
    p.add_argument("--checkpoint-activations", nargs="?", const="full", default="none",
                   choices=("none", "selective", "full"),
                   help="recompute activations in backward instead of keeping them: full (alone: every block's) or "
                        "selective (attention's scores, softmax and weighted sum only)")
    p.add_argument("--attention", default=d.attention, choices=("flash", "math"),
                   help="flash (fused: no T × T scores kept) or math (the scores written out and kept, as before "
                        "FlashAttention)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: keep seq_len / tp tokens per rank between sub-layers (LayerNorm, residual)")
    p.add_argument("--impl", default=d.impl,
                   help="scratch (gpucourse's own), torch (PyTorch's) or accelerate (Hugging Face Accelerate)")
    p.add_argument("--bucket-mb", type=float, default=d.bucket_mb,
                   help="data parallel: gradient bucket size in MB, all-reduced during backward")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch per optimizer step, in sequences (= microbatch × grad_accum × dp)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (AdamW)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data order")
    p.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    p.add_argument("--straggler", metavar="RANK:MS", default=d.straggler,
                   help="plant a straggler: that rank loses MS milliseconds every step, as a slow device would")


def config_from(args) -> TrainConfig:
    """The TrainConfig the flags describe (flags a subcommand lacks keep their defaults)."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names}
    if "schedule" in given:
        if given["schedule"] is None:
            del given["schedule"]
        elif given.get("pp", 1) == 1:  # a schedule orders a pipeline: without one it would change nothing
            raise UsageError(f"--schedule {given['schedule']} orders a pipeline's stages; give --pp 2 or more with it.")
    if "no_record" in vars(args):
        given["record"] = not args.no_record
    return TrainConfig(**given)


def write_json(path: str | None, data) -> None:
    if path:
        write_atomic(path, json.dumps(data, indent=1, default=str))
        print(f"  written to {path}")
