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
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..measure import note_saved_input
from ..model import blocks_of


def checkpoint_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """Make every transformer block of ``model`` recompute its activations in backward."""
    for block in blocks_of(model):
        plain_forward = block.forward

        def forward(x, plain_forward=plain_forward):
            note_saved_input(x)  # the one tensor a checkpointed block keeps
            return checkpoint(plain_forward, x, use_reentrant=False)

        block.forward = forward
    return model
