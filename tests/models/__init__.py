"""Tests of the Qwen3 model, its parallel layouts and checkpoint conversion."""
