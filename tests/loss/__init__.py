"""Tests of stapo_megatron.loss."""
