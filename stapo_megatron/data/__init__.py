"""Prompt data: loaders for parquet / JSON lines / Hugging Face datasets, the benchmark registry,
prompt templates and encoding, a resumable sampler, and the synthetic task with its tokenizer.

Importing this package does not import torch, datasets or transformers.
"""

from stapo_megatron.data.benchmarks import BENCHMARKS, PAPER_BENCHMARKS, BenchmarkSpec, get_benchmark, load_benchmark
from stapo_megatron.data.config import PROMPT_TEMPLATES, DataConfig
from stapo_megatron.data.loaders import iter_rows, load_records
from stapo_megatron.data.prompts import (
    PromptDataset,
    PromptEncoder,
    build_prompt_dataset,
    load_prompt_records,
    render_prompt,
)
from stapo_megatron.data.records import DataError, EncodedPrompt, LoadReport, PromptRecord
from stapo_megatron.data.rows import RowSchema
from stapo_megatron.data.sampler import PromptSampler
from stapo_megatron.data.synthetic import synthetic_records, synthetic_tokenizer

__all__ = [
    "BENCHMARKS",
    "PAPER_BENCHMARKS",
    "PROMPT_TEMPLATES",
    "BenchmarkSpec",
    "DataConfig",
    "DataError",
    "EncodedPrompt",
    "LoadReport",
    "PromptDataset",
    "PromptEncoder",
    "PromptRecord",
    "PromptSampler",
    "RowSchema",
    "build_prompt_dataset",
    "get_benchmark",
    "iter_rows",
    "load_benchmark",
    "load_prompt_records",
    "load_records",
    "render_prompt",
    "synthetic_records",
    "synthetic_tokenizer",
]
