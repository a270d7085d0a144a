"""Every random-number state a rank uses, captured and restored for exact resume."""

from __future__ import annotations

import random

import torch

from stapo_megatron.runtime.distributed import accelerator_available


def capture() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if accelerator_available():
        state["accelerator"] = torch.cuda.get_rng_state()
    return state


def restore(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "accelerator" in state:
        torch.cuda.set_rng_state(state["accelerator"])
