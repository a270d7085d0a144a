"""SGLang's ``/generate`` as data: the request bodies of a batch of prompts, and the completions of an
answer, checked against the weight version last sent. The shapes follow SGLang's server source
(0.5.15 .. 0.5.23); :class:`~stapo_megatron.rollout.sglang_engine.SGLangEngine` sends them.
"""

from __future__ import annotations

from typing import Any

from stapo_megatron.rollout.engine import Completion, SamplingParams
from stapo_megatron.rollout.server_pool import NEUTRAL_SAMPLING
from stapo_megatron.rollout.sglang_client import SGLangResponseError

SEED_MODULUS = 2**31 - 1


class AbortedSample(Exception):
    """A sample came back with finish_reason abort (server paused, preempted or restarting)."""


class StaleAnswer(Exception):
    """A server answered with weights other than the version last sent (it restarted unnoticed)."""


def generate_requests(
    prompts: list[list[int]], params: SamplingParams, max_prompts_per_request: int
) -> list[tuple[int, int, dict]]:
    """(first prompt index, prompt count, /generate body) per chunk of at most ``max_prompts_per_request``
    prompts."""
    sampling: dict[str, Any] = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k if params.top_k > 0 else -1,  # SGLang: -1 disables top-k
        "max_new_tokens": params.max_new_tokens,
        # sent even when empty, so a server-preferred list cannot add stops
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        **NEUTRAL_SAMPLING,
    }
    chunks = []
    for start in range(0, len(prompts), max_prompts_per_request):
        part = prompts[start : start + max_prompts_per_request]
        if params.seed is None:
            input_ids: list[list[int]] = part
            sampling_params: Any = sampling
        else:
            # One seed shared by n samples would make them identical, so each sample becomes its own
            # n=1 request item with a seed derived from (seed, prompt index, sample index): results
            # then do not depend on chunking or on which server runs them. 'sampling_seed' is SGLang's
            # key (0.5.22+ rejects unknown keys such as 'seed'; earlier versions ignore unknown keys).
            input_ids, sampling_params = [], []
            for j, ids in enumerate(part):
                for s in range(params.n):
                    input_ids.append(ids)
                    seed = (params.seed * 1_000_003 + (start + j) * params.n + s) % SEED_MODULUS
                    sampling_params.append({**sampling, "n": 1, "sampling_seed": seed})
        body = {
            "input_ids": input_ids,
            "sampling_params": sampling_params,
            "return_logprob": True,
            "logprob_start_len": -1,  # log-probs of output tokens only
        }
        chunks.append((start, len(part), body))
    return chunks


def parse_generate(
    data: Any, num_prompts: int, n: int, url: str, weight_version: str | None = None
) -> list[list[Completion]]:
    """SGLang's /generate answer (one dict, or a flat list of num_prompts*n grouped by prompt) -> completions.

    With ``weight_version``, every sample must report it in ``meta_info.weight_version``."""
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list) or len(items) != num_prompts * n:
        got = len(items) if isinstance(items, list) else type(data).__name__
        raise SGLangResponseError(f"{url}/generate returned {got} items for {num_prompts} prompts x n={n}")
    groups: list[list[Completion]] = []
    for p in range(num_prompts):
        group = []
        for s in range(n):
            item = items[p * n + s]
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} has no meta_info")
            served = meta.get("weight_version")
            if weight_version is not None and served is not None and str(served) != weight_version:
                raise StaleAnswer(f"{url} answered with weight version {served!r}, expected {weight_version!r}")
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind == "abort":
                message = reason.get("message", "") if isinstance(reason, dict) else ""
                raise AbortedSample(f"{url}/generate aborted a sample: {message or reason}")
            if kind not in ("stop", "length"):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} has finish_reason {reason!r}")
            entries = meta.get("output_token_logprobs")
            if not isinstance(entries, list):
                raise SGLangResponseError(f"{url}/generate item {p * n + s} lacks output_token_logprobs")
            try:
                # [logprob, token_id, text_or_null]: the token ids here are what was sampled, stop token
                # included (output_ids may have the matched stop token trimmed).
                token_ids = [int(e[1]) for e in entries]
                logprobs = [float(e[0]) for e in entries]
            except (TypeError, ValueError, IndexError):
                raise SGLangResponseError(
                    f"{url}/generate item {p * n + s} has malformed output_token_logprobs"
                ) from None
            group.append(Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=kind))
        groups.append(group)
    return groups
