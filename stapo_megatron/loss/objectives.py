"""Policy objectives: the per-token policy-gradient term that :class:`~stapo_megatron.loss.PolicyLoss`
weights and sums, a registry selected by ``AlgoConfig.objective``.

Why a registry of its own and not token rules: a token rule maps statistics to keep weights
*before* the loss, and its zeros leave the denominator (STAPO's renormalization over kept tokens).
The methods here change the surrogate itself and read the current and old log-probs inside the
loss: Clip-Cov zeroes the term of a few tokens that stay in the denominator (its authors multiply
the token loss by 0 and aggregate with the unchanged response mask), KL-Cov adds a penalty to a
few tokens, GSPO replaces the token ratio by a sequence ratio. Rules and objectives compose: the
objective acts on the tokens the rule keeps (``active``: kept by the rule and not rejected by
masked importance sampling).

Scope of the covariance (Clip-Cov, KL-Cov): the tokens of one loss call, i.e. one micro-batch on
one data-parallel rank, as in the reference code, whose ``compute_policy_loss_*`` runs per
micro-batch (verl ``verl/trainer/ppo/core_algos.py``). With token-budget micro-batches that is many
sequences; it is not the optimizer mini-batch, whatever ``AlgoConfig.scope`` says (that field is the
token rules' threshold scope).

Tensor parallelism: every input here is per token and identical on every TP rank (the log-probs
come out of an all-reduce), so covariances, top-k and candidate sets agree without communication;
Clip-Cov's random pick uses a CPU generator seeded alike on every TP rank (:func:`token_seed`). No
collective is issued here.

Packed rows: GSPO's sequence ratio is formed per ``segment_ids`` (several sequences in one row), or
per row of a 2-D input without them; the covariance methods are per token and need neither.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from stapo_megatron.loss.metrics import Reduction, declare
from stapo_megatron.loss.rollout_correction import sequence_sums

METRIC_DTYPE = torch.float64

# Raw metrics of the objectives (one micro-batch; summed over micro-batches and ranks).
declare(
    Reduction.SUM,
    {
        "cov_candidate_tokens": "clip_cov: tokens in the loss, not clipped by the ratio, with lb < Cov < ub",
        "cov_selected_tokens": "clip_cov / kl_cov: tokens the covariance picked (gradient detached / KL-penalised)",
        "kl_cov_penalty_sum": "kl_cov: sum over the picked tokens of kl_cov_coef * |log r|",
        "gspo_sequences": "gspo: sequences with a token in the loss",
        "gspo_clipped_sequences": "gspo: sequences whose ratio s_i is clipped on the side A pushes it",
    },
)


@dataclasses.dataclass
class SurrogateInputs:
    logprob: torch.Tensor  # log pi_theta of the sampled tokens, carrying the gradient
    log_ratio: torch.Tensor  # fp32 log(pi_theta / pi_old), clamped to +-log_ratio_clamp, 0 where not active
    advantages: torch.Tensor  # fp32 per token
    active: torch.Tensor  # bool: tokens in the loss (kept by the token rule, accepted by rollout correction)
    eps_low: float
    eps_high: float
    clip_ratio_c: float
    log_ratio_clamp: float
    segment_ids: torch.Tensor | None = None  # each token's sequence (packed rows)
    cfg: object = None  # the objective's parameters (AlgoConfig fields); None: the objective has none
    seed: int = 0  # of random selections (the same on every TP rank)


@dataclasses.dataclass
class Surrogate:
    pg: torch.Tensor  # fp32 per-token policy-gradient loss term
    ratio: torch.Tensor  # the ratio the clip reads (token r, or GSPO's s_i,t), for the metrics
    dual_clipped: torch.Tensor  # bool: A < 0 tokens whose term the dual-clip caps
    metrics: dict[str, torch.Tensor]  # fp64 scalar sums (reduced by SUM over micro-batches and ranks)
    clip_range: tuple[float, float]  # (eps_low, eps_high) of the ratio's clip, for the clip metrics; (1, inf): none
    selected: torch.Tensor | None = None  # bool: tokens the method singled out (Clip-Cov, KL-Cov)


def clipped_surrogate(ratio, advantages, eps_low, eps_high, clip_ratio_c):
    """PPO's clip with clip-higher and dual-clip (Ye et al. 2020; veRL ``clip_ratio_c``).

    Returns (pg, clipped, dual_clipped): pg_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),
    then min(pg_t, -A clip_ratio_c) where A < 0; ``clipped``: the clipped branch is strictly larger
    (verl's ``clip_by_origin``); ``dual_clipped``: the dual-clip cap is active."""
    unclipped = -advantages * ratio
    by_clip = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_clipped = torch.maximum(unclipped, by_clip)
    dual_cap = -advantages * clip_ratio_c
    dual_clipped = (advantages < 0) & (pg_clipped > dual_cap)
    pg = torch.where(advantages < 0, torch.minimum(pg_clipped, dual_cap), pg_clipped)
    return pg, by_clip > unclipped, dual_clipped


def token_covariance(advantages: torch.Tensor, logprob: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """Cui et al.'s per-token covariance term (fp64, no gradient), centred over the ``active`` tokens:
    Cov_t = (A_t - mean A) * (log pi_t - mean log pi). Every active token counts, those with A = 0 too.
    -inf outside ``active``."""
    with torch.no_grad():
        a = advantages.double()
        lp = logprob.detach().double()
        count = active.sum().clamp(min=1)
        mean_a = torch.where(active, a, 0.0).sum() / count
        mean_lp = torch.where(active, lp, 0.0).sum() / count
        return torch.where(active, (a - mean_a) * (lp - mean_lp), -math.inf)


def token_seed(labels: torch.Tensor) -> int:
    """A seed from a micro-batch's token ids: the same on every TP rank (same labels), different
    between micro-batches, and the same again when a step is rerun or resumed."""
    flat = labels.reshape(-1).long() % 1_000_003
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long) % 65_521 + 1
    return int((flat * weights).sum()) % (2**31 - 1)


def _mask_of(flat_indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(like.numel(), dtype=torch.bool, device=like.device)
    mask[flat_indices] = True
    return mask.view(like.shape)


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.to(METRIC_DTYPE).sum()


class Objective:
    """Registry entry. ``surrogate`` maps :class:`SurrogateInputs` to a :class:`Surrogate`."""

    name = ""
    reads_zero_advantage = False  # whether a token with A = 0 changes other tokens' terms
    draws_random = False  # whether ``surrogate`` reads ``seed``

    def surrogate(self, x: SurrogateInputs) -> Surrogate:
        raise NotImplementedError


class PPOClip(Objective):
    """The token-level clipped surrogate (Schulman et al. 2017) with clip-higher (DAPO) and
    dual-clip: r_t = pi_theta / pi_old per token, pg_t from :func:`clipped_surrogate`. The
    objective of STAPO, GRPO, DAPO, 20-Entropy and JustRL in this project."""

    name = "ppo_clip"

    def surrogate(self, x):
        ratio = torch.exp(x.log_ratio)
        pg, _, dual_clipped = clipped_surrogate(ratio, x.advantages, x.eps_low, x.eps_high, x.clip_ratio_c)
        return Surrogate(pg, ratio, dual_clipped, {}, (x.eps_low, x.eps_high))


class ClipCov(Objective):
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", arXiv 2505.22617; code: PRIME-RL/Entropy-Mechanism-of-RL and verl
    ``core_algos.py::compute_policy_loss_clip_cov``).

    Definition: the PPO clipped surrogate, except that a few high-covariance tokens lose their
    gradient. With Cov_t = (A_t - mean A)(log pi_t - mean log pi) over the loss call's tokens
    (:func:`token_covariance`), the candidates are the tokens the ratio clip leaves alone
    (-A clip(r) <= -A r) with ``clip_cov_lb`` < Cov_t < ``clip_cov_ub``; of these,
    max(floor(``clip_cov_ratio`` * N), 1) chosen uniformly at random (N: tokens in the loss) get
    pg_t = 0 and stay in the token count (the reference multiplies the token loss by 0 and keeps its
    mask). Defaults of the reference code and verl: clip_cov_ratio 2e-4, clip_cov_lb 1.0,
    clip_cov_ub 5.0; the authors' recipe (verl ``recipe/entropy/7b_clip_cov.sh``) sets
    clip_ratio_low = clip_ratio_high = 1, so that Clip-Cov rather than the ratio clip restrains
    the update (the ``clip_cov`` preset).

    Dual-clip: not in the reference (its dual-clip lines are commented out; verl's Clip-Cov has
    none); here ``clip_ratio_c`` still caps A < 0 tokens as in the project's other objectives, and
    the candidate test reads only the ratio clip, as the reference does. The random pick uses a
    generator seeded by ``seed`` (the reference draws ``torch.randperm`` from the global RNG)."""

    name = "clip_cov"
    reads_zero_advantage = True  # mean A runs over every token, and A = 0 tokens can be picked
    draws_random = True

    def surrogate(self, x):
        cfg = x.cfg
        if cfg is None:
            raise ValueError("objective_cfg: clip_cov needs clip_cov_ratio, clip_cov_lb and clip_cov_ub")
        ratio = torch.exp(x.log_ratio)
        pg, clipped, dual_clipped = clipped_surrogate(ratio, x.advantages, x.eps_low, x.eps_high, x.clip_ratio_c)
        cov = token_covariance(x.advantages, x.logprob, x.active)
        candidates = x.active & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
        tokens = int(x.active.sum())
        budget = max(math.floor(cfg.clip_cov_ratio * tokens), 1)
        index = torch.nonzero(candidates.reshape(-1)).reshape(-1)
        if index.numel() > budget:
            generator = torch.Generator().manual_seed(x.seed)
            pick = torch.randperm(index.numel(), generator=generator)[:budget]
            index = index[pick.to(index.device)]
        selected = _mask_of(index, candidates)
        pg = torch.where(selected, torch.zeros_like(pg), pg)
        metrics = {"cov_candidate_tokens": _count(candidates), "cov_selected_tokens": _count(selected)}
        return Surrogate(pg, ratio, dual_clipped & ~selected, metrics, (x.eps_low, x.eps_high), selected)


class KLCov(Objective):
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617; code: PRIME-RL/Entropy-Mechanism-of-RL and verl
    ``core_algos.py::compute_policy_loss_kl_cov``).

    Definition: the unclipped surrogate pg_t = -A r_t for every token, plus
    ``kl_cov_coef`` * |log r_t| on the top-k tokens by Cov_t (:func:`token_covariance`), with
    k = max(floor(``kl_cov_ratio`` * N), 1) of the N tokens in the loss. No ratio clip: the
    penalty replaces it, so ``eps_low``, ``eps_high`` and ``clip_ratio_c`` do not act here.
    Defaults: the authors' code k_percent = 0.2 (percent: kl_cov_ratio 0.002) and ppo_kl_coef 1;
    verl's defaults are kl_cov_ratio 2e-4 and ppo_kl_coef 0.1 (actor.yaml; 1.0 when unset in
    code). Ties in Cov at the k-th place are broken by ``torch.topk``, the same on every TP rank."""

    name = "kl_cov"
    reads_zero_advantage = True  # mean A runs over every token, and A = 0 tokens can be picked

    def surrogate(self, x):
        cfg = x.cfg
        if cfg is None:
            raise ValueError("objective_cfg: kl_cov needs kl_cov_ratio and kl_cov_coef")
        ratio = torch.exp(x.log_ratio)
        cov = token_covariance(x.advantages, x.logprob, x.active)
        index = torch.nonzero(x.active.reshape(-1)).reshape(-1)
        if index.numel():
            k = max(math.floor(cfg.kl_cov_ratio * index.numel()), 1)
            index = index[torch.topk(cov.reshape(-1)[index], k).indices]
        selected = _mask_of(index, x.active)
        penalty = cfg.kl_cov_coef * x.log_ratio.abs()
        pg = -x.advantages * ratio + torch.where(selected, penalty, torch.zeros_like(penalty))
        metrics = {
            "cov_selected_tokens": _count(selected),
            "kl_cov_penalty_sum": torch.where(selected, penalty.detach(), 0).to(METRIC_DTYPE).sum(),
        }
        return Surrogate(pg, ratio, torch.zeros_like(x.active), metrics, (1.0, math.inf), selected)


class GSPO(Objective):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071; verl
    ``core_algos.py::compute_policy_loss_gspo``).

    Definition: the sequence ratio s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|), the geometric mean
    of the token ratios, clipped at [1 - eps_low, 1 + eps_high] with the sequence's advantage:
    J = mean_i min(s_i A_i, clip(s_i) A_i). In the paper's token-level variant (GSPO-token, with
    every token of a sequence given the sequence's advantage)
    s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]: its value is s_i and its gradient
    flows through every token's log-prob; averaged per sequence
    (``aggregation: seq_mean_token_mean``, which verl hard-codes for GSPO and the config requires)
    this is exactly the sequence objective and its gradient. |y_i| counts the sequence's tokens in
    the loss. Paper defaults: eps_low 3e-4, eps_high 4e-4 (Sec. 5.1; verl's example scripts).

    The token log-ratios averaged into log s_i and log s_i,t itself are clamped to
    +-``log_ratio_clamp`` (verl clamps log s_i,t at 10 above). Dual-clip is not in
    the paper or verl's GSPO; ``clip_ratio_c`` caps A < 0 sequences with s_i > clip_ratio_c as in the
    project's other objectives (with GSPO's clip ranges, s_i near 1, it never acts in practice)."""

    name = "gspo"

    def surrogate(self, x):
        segments = x.segment_ids
        if segments is None:
            if x.logprob.dim() != 2:
                raise ValueError(
                    f"logprob: gspo needs [sequences, tokens] or segment_ids, got shape {tuple(x.logprob.shape)}"
                )
            segments = torch.arange(x.logprob.shape[0], device=x.logprob.device).unsqueeze(1).expand_as(x.logprob)
        active = x.active.to(torch.float32)
        counts = sequence_sums(active, segments)
        seq_log_ratio = (sequence_sums(x.log_ratio.detach(), segments) / counts.clamp(min=1))[segments]
        lp = x.logprob.float()
        log_s = torch.where(x.active, seq_log_ratio + lp - lp.detach(), torch.zeros_like(lp))
        ratio = torch.exp(log_s.clamp(-x.log_ratio_clamp, x.log_ratio_clamp))
        pg, clipped, dual_clipped = clipped_surrogate(ratio, x.advantages, x.eps_low, x.eps_high, x.clip_ratio_c)
        with torch.no_grad():
            sequences = counts > 0
            clipped_sequences = sequences & (sequence_sums((x.active & clipped).to(torch.float32), segments) > 0)
        metrics = {"gspo_sequences": _count(sequences), "gspo_clipped_sequences": _count(clipped_sequences)}
        return Surrogate(pg, ratio, dual_clipped, metrics, (x.eps_low, x.eps_high))


OBJECTIVES: dict[str, Objective] = {}


def register_objective(objective: Objective) -> Objective:
    """Add ``objective`` under its name; ``AlgoConfig.objective`` accepts every registered name."""
    if objective.name in OBJECTIVES:
        raise ValueError(f"objective: '{objective.name}' is already registered")
    OBJECTIVES[objective.name] = objective
    return objective


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"objective: unknown objective '{name}' (known: {', '.join(sorted(OBJECTIVES))})") from None


for _objective in (PPOClip(), ClipCov(), KLCov(), GSPO()):
    register_objective(_objective)
