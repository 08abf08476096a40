"""Exercise 7: how much memory training needs, before anything runs.

Taught in notebooks/07_memory_batch.ipynb; check your work with
``from gpucourse import check; check("ex07")`` or ``gpucourse grade ex07``.
Compare with the reference, gpucourse/modeled/memory.py (``estimate_params`` and
``largest_microbatch``), once yours passes.

Training a model of P parameters with Adam keeps four things per parameter:
the weight, its gradient, and Adam's two moments (``exp_avg`` and
``exp_avg_sq``), which are always fp32. The activations saved for backward come
on top and grow with the microbatch.

``model_state_bytes(num_params, precision="fp32", master_weights=False, dp=1, zero=0)``
    The bytes ONE rank holds, as ``{"weights": ..., "gradients": ..., "optimizer": ...}``,
    each an int (a whole number of bytes).

    - ``precision="fp32"``: weights 4 bytes, gradients 4, optimizer 8 (two
      moments): the famous 16 bytes per parameter.
    - ``"bf16"`` or ``"fp16"`` with ``master_weights=False`` is autocast: the
      parameters stay fp32 and only each matrix multiply's inputs are cast, so
      the bytes are fp32's (autocast saves activation memory, not this).
    - With ``master_weights=True`` the model itself is half precision: weights
      2 bytes, gradients 2, and the optimizer keeps an fp32 master copy of
      every weight (4) beside the two moments (8): 2 + 2 + 12 = 16 again.
    - ZeRO over ``dp`` data-parallel ranks cuts state into dp shards of
      S = ceil(num_params / dp) elements: stage 1 shards the optimizer state,
      stage 2 the gradients too, stage 3 the weights too; a sharded category
      holds S elements per rank. Stage 0 shards nothing (num_params each).
    - Stages 1 and 2 keep every weight in one flat buffer padded to S·dp
      elements (as in exercise 4), so what they do not shard counts S·dp
      elements, not num_params.

``largest_microbatch(budget_bytes, fixed_bytes, bytes_per_sequence)``
    A rank holds ``fixed_bytes`` whatever the microbatch (the model states
    above and a few buffers), plus ``bytes_per_sequence`` of saved activations
    for each sequence of its microbatch. Return the most sequences b (an int)
    for which ``fixed_bytes + b * bytes_per_sequence <= budget_bytes``, and 0
    when not even the fixed bytes fit. This is what ``gpucourse batch-size``
    finds from the estimate; the global batch is then b × grad_accum × dp.
"""


def model_state_bytes(num_params: int, precision: str = "fp32", master_weights: bool = False,
                      dp: int = 1, zero: int = 0) -> dict:
    """Bytes of weights, gradients and optimizer state one rank holds for a model of ``num_params``."""
    raise NotImplementedError("model_state_bytes")


def largest_microbatch(budget_bytes: float, fixed_bytes: float, bytes_per_sequence: float) -> int:
    """The most sequences one forward can take while ``fixed_bytes`` plus their activations fit the budget."""
    raise NotImplementedError("largest_microbatch")
