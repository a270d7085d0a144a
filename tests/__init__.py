"""stapo_megatron's tests."""
