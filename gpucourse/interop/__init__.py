"""The same layout written for other stacks: ``--print-config`` for training (``stack_config``: Megatron-LM, NeMo,
DeepSpeed, torchtitan, Accelerate) and for serving (``serve_config``: vLLM and TensorRT-LLM)."""
