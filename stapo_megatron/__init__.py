"""stapo_megatron: STAPO reinforcement learning of Qwen3 models on Megatron-Core."""

__version__ = "0.1.0"
