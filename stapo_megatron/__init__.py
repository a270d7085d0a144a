"""stapo_megatron: STAPO reinforcement learning of Qwen3 models on Megatron-Core."""

import warnings

__version__ = "0.1.0"

# Megatron-Core warnings that say nothing to act on, filtered here (by message, category and
# origin) because every entry point (the CLI, the ranks, the tools) imports this package first:
# - at import, once per module: Transformer Engine or Apex is missing and it falls back to torch,
#   which is this project's CPU and plain-torch path (the TE layer spec is used whenever TE imports);
# - at every TransformerConfig: its own default cuda_graph_scope="full" is deprecated (0.16.1),
#   although no CUDA graph is captured.
warnings.filterwarnings(
    "ignore",
    message=r"(Transformer Engine and )?Apex (is|are) not installed",
    category=UserWarning,
    module=r"megatron\.core",
)
warnings.filterwarnings(
    "ignore",
    message=r"full scope is deprecated",
    category=UserWarning,
    module=r"megatron\.core\.transformer\.transformer_config",
)
