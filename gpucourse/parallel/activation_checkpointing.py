"""Activation checkpointing: trade compute for memory, one block at a time.

Backward needs the activations forward computed: every block normally keeps
its intermediate tensors (attention inputs, the 4×-wide MLP hidden layer, ...)
alive from its forward until its backward. With checkpointing a block keeps
only its *input*; in backward it runs its forward again to rebuild what it
needs, then back-propagates. Saved activations per block drop from a dozen
tensors to one, at the price of one extra forward per block (about a third
more compute). Gradients, and therefore the losses, are exactly the same.

``checkpoint_blocks`` changes each block's ``forward`` in place rather than
wrapping the block in another module, so parameter names (and checkpoints and
exported weights) stay those of the plain model.

Selective recomputation (Korthikanti et al. 2022, Megatron-LM's
``--recompute-activations``) recomputes only attention's core — scores,
softmax, dropout, the weighted sum — whose saved tensors grow with T² per head
while its FLOPs are a small share of the block's: ``checkpoint_attention``.
With attention written out (``attention="math"``) that frees the T × T tensors
for a few percent more compute. A fused kernel (``"flash"``) never keeps them:
it recomputes the scores in its own backward, which is selective recomputation
built into the kernel, so there only its log-sum-exp is left to free.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..measure import note_saved_input
from ..model import blocks_of
from ..readable import ConfigError


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Make every transformer block of ``model`` recompute its activations in backward."""
    for block in blocks_of(model):
        plain_forward = block.forward

        def forward(x, plain_forward=plain_forward):
            note_saved_input(x)  # the one tensor a checkpointed block keeps
            return checkpoint(plain_forward, x, use_reentrant=False)

        block.forward = forward
    return model


def checkpoint_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Make every block's attention core (``attend``: queries, keys and values in, the weighted sum out) recompute
    in backward. The projections around it keep what they keep."""
    for block in blocks_of(model):
        plain_attend = block.attn.attend

        def attend(q, k, v, plain_attend=plain_attend):
            for t in (q, k, v):
                note_saved_input(t)  # what the recomputation starts from, kept instead of the scores
            return checkpoint(plain_attend, q, k, v, use_reentrant=False)

        block.attn.attend = attend
    return model


def recompute(model: torch.nn.Module, what: str) -> torch.nn.Module:
    """Apply a run's recomputation, ``TrainConfig.recompute``: "none", "selective" or "full"."""
    if what == "full":
        return checkpoint_blocks(model)
    if what == "selective":
        return checkpoint_attention(model)
    return model


# --- how the engine applies it ---------------------------------------------------------------------------------------

def apply(model, mesh, cfg, built):
    """The run's recomputation, ``cfg.recompute``, on this rank's blocks (no mesh needed)."""
    return recompute(model, cfg.recompute)


# --- its rules -----------------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")  # what backward recomputes (TrainConfig.checkpoint_activations)
ATTENTION = ("flash", "math")              # how attention computes (model.GPTConfig.attention)


def check(cfg, mc, runnable: bool = True) -> None:
    """What recomputation and the attention kernel it works on refuse, one sentence each."""
    if cfg.recompute not in RECOMPUTE:
        raise ConfigError(f"checkpoint_activations={cfg.checkpoint_activations!r} is not one of "
                          f"{', '.join(RECOMPUTE)} (or False / True).")
    if cfg.attention not in ATTENTION:
        raise ConfigError(f"attention={cfg.attention!r} is not one of {', '.join(ATTENTION)}.")
    if cfg.attention == "math" and cfg.precision != "fp32" and not cfg.master_weights:
        raise ConfigError(f"attention='math' under autocast keeps its scores in whatever precision the device's "
                          f"autocast lists give softmax (fp32 on CUDA, {cfg.precision} on CPU); run it in fp32 "
                          f"or with master_weights, where the scores' precision is the weights'.")
