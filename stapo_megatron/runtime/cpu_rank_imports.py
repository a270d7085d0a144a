"""Imported once by the fork server that starts :func:`~stapo_megatron.runtime.launch.spawn_ranks`'
ranks on a machine without CUDA: the CPU layer, installed first as a rank installs it, and the
Megatron-Core and transformers modules every rank imports. Forked from the server, a rank starts with
them loaded. Nothing here reads the environment or the arguments of a call: the server starts once,
at the first call, and serves every later one."""

from stapo_megatron.runtime.distributed import prepare_megatron_import

prepare_megatron_import()

import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import transformers  # noqa: E402,F401
