"""The embedded rollout engine: batched sampling in-process with transformers' Qwen3.

For CPU runs, tests and small models. It takes the same (Hugging Face name, tensor) stream as
SGLang, and reports for each sampled token the log-probability of the full distribution at the
sampling temperature (before any top-p / top-k cut), which is what the trainer recomputes.
Its sampler has temperature, top-p and top-k only: no min-p and no repetition, frequency or
presence penalty, the same neutral settings the SGLang engine pins in every request
(``sglang_engine.NEUTRAL_SAMPLING``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch

from stapo_megatron.models.qwen3.config import Qwen3Config
from stapo_megatron.rollout.config import LocalEngineConfig
from stapo_megatron.rollout.engine import Completion, RolloutEngine, SamplingParams


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf (the sampling distribution, not the log-probs)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class LocalEngine(RolloutEngine):
    """Qwen3ForCausalLM in this process; weights arrive through :meth:`load_weights`."""

    def __init__(self, arch: Qwen3Config, config: LocalEngineConfig | None = None, device: torch.device | str = "cpu"):
        from transformers import Qwen3Config as HFQwen3Config
        from transformers import Qwen3ForCausalLM

        self.config = config or LocalEngineConfig()
        self.device = torch.device(device)
        hf_config = HFQwen3Config(
            **{k: v for k, v in arch.to_hf_dict().items() if k not in ("architectures", "torch_dtype")}
        )
        # Built with transformers' own initialisation (small models only); generate() refuses to
        # sample until load_weights has replaced every parameter.
        # transformers wraps PreTrainedModel.to in a decorator whose type hides the bound self
        dtype = getattr(torch, self.config.dtype)
        model = Qwen3ForCausalLM(hf_config).to(device=self.device, dtype=dtype)  # type: ignore[call-arg]
        self.model = model.eval()
        self.model.requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self._loaded = False
        self._cache_kwarg = (
            "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        )
        self.weight_version: int | None = None  # load_weights' version: every token generated since carries it

    # ---- weights ---------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> None:
        seen = set()
        for name, tensor in named_tensors:
            param = self._params.get(name)
            if param is None:
                raise ValueError(f"load_weights: {name} is not a parameter of the rollout model")
            if name in seen:
                raise ValueError(f"load_weights: {name} arrived twice")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"load_weights: {name} has shape {list(tensor.shape)}, expected {list(param.shape)}")
            param.copy_(tensor)
            seen.add(name)
        missing = sorted(set(self._params) - seen)
        if missing:
            raise ValueError(
                f"load_weights: {missing[0]} was not sent ({len(missing)} missing); old weights would remain"
            )
        self._loaded = True
        self.weight_version = version

    def release_memory(self) -> None:
        self.model.to("cpu")
        self._params = dict(self.model.named_parameters())

    def resume_memory(self) -> None:
        self.model.to(self.device)
        self._params = dict(self.model.named_parameters())

    def shutdown(self) -> None:
        self._params = {}
        self.model = None

    # ---- sampling ----------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        if self.model is None:
            raise RuntimeError("LocalEngine was shut down")
        if not self._loaded:
            raise RuntimeError("LocalEngine.generate before load_weights: the model has no weights")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("LocalEngine.generate: empty prompt")
        generator = torch.Generator(device=self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        flat = [list(p) for p in prompts for _ in range(params.n)]
        completions: list[Completion] = []
        for start in range(0, len(flat), self.config.max_batch_size):
            completions.extend(
                self._generate_batch(flat[start : start + self.config.max_batch_size], params, generator)
            )
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[Completion]:
        batch, width = len(prompts), max(len(p) for p in prompts)
        version = self.weight_version
        # Left padding keeps every sequence's next token in the last column.
        input_ids = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        attention = torch.zeros(batch, width, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, device=self.device)
            attention[i, width - len(p) :] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=self.device)
        tokens = torch.zeros(batch, params.max_new_tokens, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(batch, params.max_new_tokens, dtype=torch.float32, device=self.device)
        lengths = torch.full((batch,), params.max_new_tokens, dtype=torch.long, device=self.device)
        running = torch.ones(batch, dtype=torch.bool, device=self.device)
        cache = None
        step_ids, step_positions = input_ids, positions
        for step in range(params.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=attention,
                position_ids=step_positions,
                use_cache=True,
                **{self._cache_kwarg: cache},
            )
            cache = getattr(out, "cache", None) or out.past_key_values
            logits = out.logits[:, -1].float() / params.temperature
            log_probs = torch.log_softmax(logits, dim=-1)
            sampling = torch.softmax(_filter_logits(logits, params.top_k, params.top_p), dim=-1)
            choice = torch.multinomial(sampling, 1, generator=generator).squeeze(-1)
            tokens[:, step] = choice
            logprobs[:, step] = log_probs.gather(-1, choice[:, None]).squeeze(-1)
            stopped = running & torch.isin(choice, stop_ids)
            lengths[stopped] = step + 1
            running &= ~stopped
            if not running.any():
                break
            step_ids = choice[:, None]
            step_positions = step_positions[:, -1:] + 1
            attention = torch.cat([attention, torch.ones(batch, 1, dtype=attention.dtype, device=self.device)], dim=1)
        out_tokens, out_logprobs, out_lengths = tokens.tolist(), logprobs.tolist(), lengths.tolist()
        finished = (~running).tolist()
        return [
            Completion(
                token_ids=out_tokens[i][: out_lengths[i]],
                logprobs=out_logprobs[i][: out_lengths[i]],
                finish_reason="stop" if finished[i] else "length",
                versions=None if version is None else [version] * out_lengths[i],
            )
            for i in range(batch)
        ]
