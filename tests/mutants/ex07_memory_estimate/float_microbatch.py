"""Mutant of ex07_memory_estimate: leaves out int(), so a budget given as a float gives a float count."""


def model_state_bytes(num_params: int, precision: str = "fp32", master_weights: bool = False,
                      dp: int = 1, zero: int = 0) -> dict:
    """Bytes of weights, gradients and optimizer state one rank holds for a model of ``num_params``."""
    half = precision != "fp32" and master_weights  # autocast keeps fp32 parameters: only the matmuls are half
    weight_bytes = 2 if half else 4
    optimizer_bytes = 8 + (4 if half else 0)       # two fp32 moments, plus the fp32 master copy
    shard = -(-num_params // dp)                   # ceil: every rank holds an equal, padded shard
    flat = shard * dp if zero in (1, 2) else num_params  # stages 1 and 2 keep one padded flat buffer
    return {
        "weights": weight_bytes * (shard if zero == 3 else flat),
        "gradients": weight_bytes * (shard if zero >= 2 else flat),
        "optimizer": optimizer_bytes * (shard if zero >= 1 else num_params),
    }


def largest_microbatch(budget_bytes: float, fixed_bytes: float, bytes_per_sequence: float) -> int:
    """The most sequences one forward can take while ``fixed_bytes`` plus their activations fit the budget."""
    if budget_bytes < fixed_bytes:
        return 0
    return (budget_bytes - fixed_bytes) // bytes_per_sequence
