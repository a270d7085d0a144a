"""SGLang's ``/generate`` as data: the request bodies of a batch of prompts, and the completions of an
answer, each token with the weight version that produced it, checked against the versions the engine
sent. The shapes follow SGLang's server source (0.5.15 .. 0.5.23);
:class:`~stapo_megatron.rollout.sglang_engine.SGLangEngine` sends them.

Which weights produced which tokens: SGLang 0.5.23 answers ``meta_info.weight_versions``, segments
``{"version": str, "start": int, "end": int}`` over the output tokens (``end`` exclusive; a new
segment starts where a weight update landed while the request ran); earlier versions answer only
``meta_info.weight_version``, the server's version when it answered. A server reports the string it
was last given (``str(version)`` of each update); one launched without ``--weight-version``, as the
engine launches them, reports ``"default"`` for its launch weights, which carry no version number.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeGuard

from stapo_megatron.rollout.engine import Completion, SamplingParams
from stapo_megatron.rollout.server_pool import NEUTRAL_SAMPLING
from stapo_megatron.rollout.sglang_client import SGLangResponseError

SEED_MODULUS = 2**31 - 1


class AbortedSample(Exception):
    """A sample came back with finish_reason abort (server paused, preempted or restarting), or its
    tokens cannot be told apart by weight version (a server older than 0.5.23 across an update)."""


class StaleAnswer(SGLangResponseError):
    """A server answered with weights the engine did not send while the request ran: its launch weights
    (it restarted unnoticed) or a version outside the request's window."""


@dataclasses.dataclass(frozen=True)
class VersionWindow:
    """The weight versions an answer may carry, in the order the engine sent them.

    ``sent``: the version every usable server held when the request went out (None: the engine had
    sent none, the launch weights); ``synced``: each version a weight sync put on the servers while
    the request ran; ``open``: a sync was under way at some point of it whose version the engine
    learns only when it completes, so one more version, after all of these, may appear.
    Tokens from more than one version are legitimate only where the window holds more than one.
    """

    sent: int | None = None
    synced: tuple[int, ...] = ()
    open: bool = False

    @property
    def numbered(self) -> bool:
        """Whether the engine numbers the weights of this request (it sent or is sending a version)."""
        return self.sent is not None or bool(self.synced) or self.open

    def describe(self) -> str:
        sent = "its launch weights" if self.sent is None else str(self.sent)
        return " then ".join([sent, *map(str, self.synced)] + (["the version being synced"] if self.open else []))


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
    data: Any, num_prompts: int, n: int, url: str, window: VersionWindow | None = None
) -> list[list[Completion]]:
    """SGLang's /generate answer (one dict, or a flat list of num_prompts*n grouped by prompt) -> completions,
    each token with the weight version that produced it (:func:`token_versions`; ``window`` None: the
    engine sent no version)."""
    window = window or VersionWindow()
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list) or len(items) != num_prompts * n:
        got = len(items) if isinstance(items, list) else type(data).__name__
        raise SGLangResponseError(f"{url}/generate returned {got} items for {num_prompts} prompts x n={n}")
    groups: list[list[Completion]] = []
    for p in range(num_prompts):
        group = []
        for s in range(n):
            where = f"{url}/generate item {p * n + s}"
            item = items[p * n + s]
            meta = item.get("meta_info") if isinstance(item, dict) else None
            if not isinstance(meta, dict):
                raise SGLangResponseError(f"{where} has no meta_info")
            reason = meta.get("finish_reason")
            kind = reason.get("type") if isinstance(reason, dict) else reason
            if kind == "abort":
                message = reason.get("message", "") if isinstance(reason, dict) else ""
                raise AbortedSample(f"{url}/generate aborted a sample: {message or reason}")
            if kind not in ("stop", "length"):
                raise SGLangResponseError(f"{where} has finish_reason {reason!r}")
            entries = meta.get("output_token_logprobs")
            if not isinstance(entries, list):
                raise SGLangResponseError(f"{where} lacks output_token_logprobs")
            try:
                # [logprob, token_id, text_or_null]: the token ids here are what was sampled, stop token
                # included (output_ids may have the matched stop token trimmed).
                token_ids = [int(e[1]) for e in entries]
                logprobs = [float(e[0]) for e in entries]
            except (TypeError, ValueError, IndexError):
                raise SGLangResponseError(f"{where} has malformed output_token_logprobs") from None
            versions = token_versions(meta, len(token_ids), where, window)
            group.append(Completion(token_ids=token_ids, logprobs=logprobs, finish_reason=kind, versions=versions))
        groups.append(group)
    return groups


def version_number(served: Any) -> int | None:
    """A served weight version as the engine's integer: the string ``str(version)`` the engine sent
    (an integer from a server that sends one); None for anything else, such as ``"default"``, the
    version of a server's launch weights."""
    if isinstance(served, int) and not isinstance(served, bool):
        return served
    if isinstance(served, str):
        try:
            number = int(served)
        except ValueError:
            return None
        return number if str(number) == served else None
    return None


def version_segments(meta: dict, count: int, where: str) -> list[tuple[Any, int, int]] | None:
    """``meta_info``'s (version, start, end) segments over the ``count`` output tokens, checked to cover
    each token once, in order; from a server without ``weight_versions`` (before 0.5.23) one segment of
    its ``weight_version``; None when the answer names no version at all."""
    segments = meta.get("weight_versions")
    if segments is None:
        served = meta.get("weight_version")
        return None if served is None else [(served, 0, count)]
    if not isinstance(segments, list):
        raise SGLangResponseError(f"{where}: weight_versions is {type(segments).__name__}, not a list of segments")
    out: list[tuple[Any, int, int]] = []
    covered = 0
    for segment in segments:
        start, end = (segment.get("start"), segment.get("end")) if isinstance(segment, dict) else (None, None)
        if not (_is_index(start) and _is_index(end) and "version" in segment):
            raise SGLangResponseError(f"{where}: weight_versions segment {segment!r} is not {{version, start, end}}")
        # SGLang names the version of an answer without output tokens by one segment [0, 0).
        if start != covered or end < start or (end == start and count > 0):
            raise SGLangResponseError(
                f"{where}: weight_versions {segments!r} do not cover the {count} output tokens in order "
                f"(a segment [{start}, {end}) where token {covered} comes next)"
            )
        out.append((segment["version"], start, end))
        covered = end
    if covered != count:
        raise SGLangResponseError(f"{where}: weight_versions {segments!r} cover {covered} of its {count} output tokens")
    return out


def _is_index(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def token_versions(meta: dict, count: int, where: str, window: VersionWindow) -> list[int] | None:
    """The weight version of each of the ``count`` output tokens of one answer item, checked against the
    versions the engine sent while the request ran.

    Each segment's version must be one of the window's, in the window's order (weights only move
    forward during a request), or, while a sync was open, one more version after them. A version
    outside it is a :class:`StaleAnswer` (a server that restarted unnoticed answers ``"default"``, its
    launch weights); segments that do not tile the output tokens are an :class:`SGLangResponseError`.
    None: the engine numbers no weights yet (the launch weights), or some tokens came from them.
    """
    segments = version_segments(meta, count, where)
    if segments is None or not window.numbered:
        return None
    timeline: list[int | None] = [window.sent, *window.synced]
    position = 0
    pending: int | None = None  # the open sync's version, once an answer shows it
    versions: list[int | None] = []
    for served, start, end in segments:
        number = version_number(served)
        later = [i for i in range(position, len(timeline)) if timeline[i] == number]
        if later:
            position = later[0]
        elif number is not None and window.open and pending in (None, number) and number not in timeline:
            position, pending = len(timeline), number
        else:
            if number is not None and number in timeline:
                raise SGLangResponseError(
                    f"{where}: weight_versions {meta.get('weight_versions')!r} go back to version {number}"
                )
            launch = " (launch weights: the server restarted)" if number is None else ""
            raise StaleAnswer(
                f"{where} was generated with weight version {served!r}{launch}; the engine sent "
                f"{window.describe()} while it ran"
            )
        versions += [number] * (end - start)
    if "weight_versions" not in meta and position > 0:
        raise AbortedSample(
            f"{where}: SGLang before 0.5.23 reports no per-token weight versions, and weights changed while "
            f"the request ran ({window.describe()}); it is sent again"
        )
    numbered = [v for v in versions if v is not None]
    return numbered if len(numbered) == count else None
