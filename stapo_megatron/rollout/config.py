"""Rollout settings: which engine generates, and how the SGLang engine launches and talks to servers."""

from __future__ import annotations

import dataclasses
from typing import Literal

from stapo_megatron.config.core import (
    MAX_BATCH,
    MAX_SEED,
    MAX_TOKENS,
    ConfigError,
    check_fields,
    field_default,
    option,
)
from stapo_megatron.rollout.sglang_launch import KEY_ENV, key_flag_in

MIB = 1 << 20
MAX_WAIT_S = 7 * 24 * 3600.0  # longest timeout: a week

WeightSyncMode = Literal["auto", "tensor", "distributed", "disk"]
Placement = Literal["colocated", "disaggregated"]


@dataclasses.dataclass
class SGLangConfig:
    """How :class:`~stapo_megatron.rollout.sglang_engine.SGLangEngine` gets its servers and uses them."""

    # --- where the servers come from ---
    placement: Placement = option(
        "disaggregated",
        "colocated: every node's local rank 0 launches one server per tp_size GPUs of its node, on the trainer's "
        "GPUs (every GPU generates; launched with --enable-memory-saver, weights synced through CUDA IPC by "
        "default). disaggregated: attach to urls, or launch num_servers on every node from base_gpu_id "
        "(GPUs the trainer does not use).",
    )
    urls: list[str] = option(
        [],
        "Attach to these running SGLang servers (http://host:port) instead of launching any; "
        "each must run with dp_size 1 for NCCL weight sync.",
    )
    model_path: str = option(
        "", "Hugging Face model directory or hub name the launched servers load; required unless urls are given."
    )
    tokenizer_path: str | None = option(None, "Tokenizer path passed to launched servers; None uses model_path.")
    num_servers: int = option(
        1,
        "Disaggregated launch: how many servers each node launches beside its trainer ranks; server i of a node "
        "uses GPUs base_gpu_id + i*tp_size .. (colocated placement derives the count from the GPUs per node).",
        ge=1,
        le=1024,
    )
    tp_size: int = option(1, "Tensor-parallel size of each launched server.", ge=1, le=1024)
    base_gpu_id: int = option(
        0, "Disaggregated launch: first GPU index (within CUDA_VISIBLE_DEVICES) the servers use.", ge=0, le=1023
    )
    host: str = option("127.0.0.1", "Address launched servers listen on.")
    base_port: int = option(
        0,
        "Port of server 0 (server i uses base_port + i); 0 reserves free ones outside the ephemeral range.",
        ge=0,
        le=65535,
    )
    mem_fraction_static: float = option(
        0.8, "Fraction of GPU memory a launched server takes for weights and KV cache.", gt=0, lt=1
    )
    dtype: str = option("auto", "Weight and activation dtype of launched servers (auto, bfloat16, float16, ...).")
    context_length: int | None = option(
        None, "Maximum context length of launched servers; None keeps the model's.", ge=1, le=MAX_TOKENS
    )
    random_seed: int = option(
        1234, "Base random seed of launched servers; server i gets random_seed + i.", ge=0, le=MAX_SEED
    )
    load_format: str = option(
        "",
        "--load-format of launched servers ('dummy' skips reading weights the trainer will send); '' = SGLang's "
        "default.",
    )
    enable_weights_cpu_backup: bool = option(
        False, "Launch with --enable-weights-cpu-backup so weights survive release_memory without a reload."
    )
    deterministic_inference: bool = option(
        False,
        "Launch with --enable-deterministic-inference: only then does SGLang use each request's sampling seed, so "
        "seeded rollouts and a resumed evaluation reproduce (the engine reads it from /server_info and warns once "
        "when seeds do not act). Off by default: SGLang measures 25-45% slower generation with it, the phase that "
        "dominates a step; it needs the FlashInfer, FA3 or Triton attention backend; and a GPU training run does not "
        "reproduce bit for bit anyway (Transformer Engine's attention backward and NCCL's reductions are not "
        "deterministic by default). Turn it on for evaluations that must resume to the same result.",
    )
    server_command: list[str] = option(
        [],
        "Program (argv prefix) that starts one server in place of `python -m stapo_megatron.rollout.sglang_launch "
        "sglang.launch_server`, e.g. a container wrapper; the usual launch flags are appended. The API key is not "
        f"among them: it arrives in ${KEY_ENV} (a command line is readable by every local user), which the "
        "sglang_launch wrapper turns into SGLang's key flags in-process.",
    )
    extra_args: list[str] = option(
        [], "Extra command-line arguments appended to every launch command (never an API key: see api_key)."
    )
    env: dict = option(
        {},
        "Extra environment variables for launched server processes (name -> value); secret: values are redacted "
        "in written configs, logs and metrics.",
        secret=True,
    )
    log_dir: str = option(
        "",
        "Directory for the launched servers' logs (node<k>/server-<i>.log, mode 0600); '' = <run directory>/sglang "
        "in a run, a temporary directory for a standalone engine.",
    )

    # --- security ---
    api_key: str | None = option(
        None,
        "API key the servers require (Bearer token). Launch mode generates a random per-run key when neither this nor "
        "api_key_env is set; attach mode refuses weight updates without a key. Secret: redacted in written configs, "
        "logs and metrics.",
        secret=True,
    )
    api_key_env: str = option(
        "STAPO_SGLANG_API_KEY",
        "Environment variable read for the API key when api_key is unset (keeps it out of configs).",
    )

    # --- waiting and retrying ---
    startup_timeout_s: float = option(
        900.0, "How long to wait for a server to answer /health and /health_generate.", gt=0, le=MAX_WAIT_S
    )
    request_timeout_s: float = option(3600.0, "Time limit of one /generate HTTP request.", gt=0, le=MAX_WAIT_S)
    control_timeout_s: float = option(
        300.0, "Time limit of one control request (pause, flush, weight update, memory).", gt=0, le=MAX_WAIT_S
    )
    max_retries: int = option(
        3, "Retries of one /generate request after a transport error, 5xx or aborted sample.", ge=0, le=1000
    )
    retry_backoff_s: float = option(1.0, "Pause before retrying a failed request.", ge=0, le=3600)
    failure_threshold: int = option(
        3,
        "Consecutive connection failures / 5xx after which a server whose process still runs counts as dead.",
        ge=1,
        le=1000,
    )
    flush_timeout_s: float = option(
        120.0, "How long to keep retrying /flush_cache while the server reports busy (400).", gt=0, le=MAX_WAIT_S
    )
    shutdown_grace_s: float = option(
        30.0, "Seconds between SIGTERM and SIGKILL when stopping a launched server.", ge=0, le=3600
    )
    max_restarts: int = option(
        1,
        "Times a launched server whose process exits is restarted by its node; after that (or for an attached "
        "server that fails again after coming back) it is dead and the run goes on without it.",
        ge=0,
        le=1000,
    )
    supervise_interval_s: float = option(
        1.0, "How often each node checks whether its launched servers' processes still run.", gt=0, le=3600
    )

    # --- batching ---
    max_prompts_per_request: int = option(8, "Prompts sent in one batched /generate request.", ge=1, le=MAX_BATCH)
    max_concurrent_requests_per_server: int = option(32, "Requests in flight to one server at a time.", ge=1, le=65536)

    # --- weight sync ---
    weight_sync: WeightSyncMode = option(
        "auto",
        "How new weights reach the servers: tensor (CUDA IPC, same node), distributed (NCCL broadcast), disk "
        "(safetensors + /update_weights_from_disk); auto = tensor when colocated, else distributed.",
    )
    weight_bucket_bytes: int = option(
        512 * MIB, "Upper bound on the bytes of one weight-update bucket.", ge=1, le=1 << 40
    )
    weight_sync_backend: Literal["nccl", "gloo"] = option(
        "nccl", "torch.distributed backend of the weight-update group (gloo only makes sense for CPU tests)."
    )
    weight_sync_master_address: str = option(
        "",
        "Address servers use to reach the trainer's weight-update store; '' = the local address that routes to them.",
    )
    weight_sync_timeout_s: float = option(
        600.0, "Time limit for joining the weight-update group and for one bucket.", gt=0, le=MAX_WAIT_S
    )
    disk_sync_dir: str = option(
        "", "Directory for disk weight sync checkpoints (must be visible to every server); '' = a temporary directory."
    )

    def __post_init__(self):
        check_fields(self)  # the engine is also given a section built directly, not through build()
        for i, url in enumerate(self.urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"urls[{i}]: '{url}' must start with http:// or https://")
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError("urls: the same server is listed twice")
        if self.base_port and self.base_port + self.num_servers - 1 > 65535:
            raise ConfigError(f"base_port: {self.base_port} + {self.num_servers} servers runs past port 65535")
        for name in ("server_command", "extra_args"):
            flag = key_flag_in(getattr(self, name))
            if flag:
                raise ConfigError(
                    f"{name}: {flag} would put the API key on a command line, readable by every local "
                    "user; set api_key or api_key_env instead"
                )
        bad_env = [k for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad_env:
            raise ConfigError(f"env: names and values must be strings (bad entry: {bad_env[0]!r})")
        if self.weight_sync == "tensor" and not self.colocated:
            raise ConfigError(
                "weight_sync: tensor (CUDA IPC) needs servers on the trainer's GPUs (placement: colocated); "
                "disaggregated servers take weights over distributed or disk"
            )
        if self.placement == "colocated" and self.num_servers != 1:
            raise ConfigError(
                "num_servers: colocated placement launches one server per tp_size GPUs on every node; "
                "num_servers applies to disaggregated placement only"
            )
        if self.placement == "colocated" and self.base_gpu_id:
            raise ConfigError(
                "base_gpu_id: colocated placement runs server i of each node on GPUs i*tp_size ..; "
                "base_gpu_id applies to disaggregated placement only"
            )

    @property
    def colocated(self) -> bool:
        """The servers share GPUs with the trainer (memory saver on, CUDA IPC weight sync by default)."""
        return self.placement == "colocated"

    @property
    def launches(self) -> bool:
        """True when the engine starts its own servers, False when it attaches to ``urls``."""
        return not self.urls

    @property
    def resolved_weight_sync(self) -> str:
        if self.weight_sync != "auto":
            return self.weight_sync
        return "tensor" if self.colocated else "distributed"

    def server_gpus(self, local_index: int) -> tuple[int, ...]:
        """The GPUs of its node that launched server ``local_index`` runs on (SGLang's --base-gpu-id onwards)."""
        first = self.base_gpu_id + local_index * self.tp_size
        return tuple(range(first, first + self.tp_size))


@dataclasses.dataclass
class LocalEngineConfig:
    """The in-process engine (:class:`~stapo_megatron.rollout.local_engine.LocalEngine`)."""

    dtype: Literal["float32", "bfloat16", "float16"] = option("float32", "dtype of the in-process model.")
    max_batch_size: int = option(256, "Most sequences decoded together in one forward pass.", ge=1, le=MAX_BATCH)


@dataclasses.dataclass
class AsyncConfig:
    """Generation overlapped with training (:mod:`~stapo_megatron.trainer.rollout_pipeline`)."""

    max_staleness: int = option(
        0,
        "How many weight versions the oldest token of a trained sample may lag the weights it is trained "
        "from. 0: the synchronous loop (generate with the latest weights, then train). k > 0: generation runs "
        "ahead of training (k steps, k - 1 with partial rollouts), so the next steps' groups are generated while "
        "the trainer updates; a group older than k is dropped and its prompt generated again.",
        ge=0,
        le=64,
    )


@dataclasses.dataclass
class PartialConfig:
    """Partial rollouts: a step does not wait for its longest responses."""

    enabled: bool = option(
        False,
        "Generate each step's pool of groups in segments of segment_tokens; once prompts_per_step groups have "
        "finished, the step trains on them and the unfinished samples (tokens, log-probs and versions kept) "
        "continue in the next step under the new weights, as the same samples. Needs async.max_staleness >= 1.",
    )
    segment_tokens: int = option(
        256,
        "Tokens every unfinished sample generates between two quorum checks (the granularity at which a "
        "step stops waiting; each segment re-sends the sample's tokens as its prompt).",
        ge=1,
        le=MAX_TOKENS,
    )
    over_sampling: float = option(
        0.25,
        "Extra groups in each step's pool, as a fraction of prompts_per_step (rounded up), so the quorum is "
        "reached without the slowest groups.",
        ge=0,
        le=16,
    )


@dataclasses.dataclass
class RolloutConfig:
    """Which rollout engine the trainer and evaluator use."""

    engine: Literal["local", "sglang"] = option(
        "local", "Rollout engine: local (in-process, for small models and tests) or sglang (SGLang servers)."
    )
    release_memory_between_steps: bool = option(
        False,
        "Free the engine's accelerator memory after each step's rollouts and take it back before the weight "
        "sync, so training can use it (for SGLang colocated with the trainer; needs --enable-memory-saver).",
    )
    local: LocalEngineConfig = option(
        doc="Local engine settings (used when engine is local).", factory=LocalEngineConfig
    )
    sglang: SGLangConfig = option(doc="SGLang engine settings (used when engine is sglang).", factory=SGLangConfig)
    async_: AsyncConfig = option(
        doc="Asynchronous rollouts: generation overlapped with training.", factory=AsyncConfig, key="async"
    )
    partial: PartialConfig = option(doc="Partial rollouts.", factory=PartialConfig)

    def __post_init__(self):
        if self.engine == "sglang" and not (self.sglang.urls or self.sglang.model_path):
            raise ConfigError("sglang.model_path: required to launch servers (or give sglang.urls to attach)")
        if not self.partial.enabled:
            for name in ("segment_tokens", "over_sampling"):
                if getattr(self.partial, name) != field_default(PartialConfig, name):
                    raise ConfigError(f"partial.{name}: acts only with partial.enabled: true")
        if self.partial.enabled and self.async_.max_staleness < 1:
            raise ConfigError(
                "partial.enabled: needs async.max_staleness >= 1 (a sample continued in the next step holds "
                "tokens of the previous weights, one version behind)"
            )
        if self.pipelined and self.engine == "sglang" and self.sglang.colocated:
            raise ConfigError(
                "async: generation overlapped with training needs servers on GPUs of their own "
                "(sglang.placement: disaggregated); colocated servers share the trainer's GPUs"
            )
        if self.pipelined and self.release_memory_between_steps:
            raise ConfigError(
                "release_memory_between_steps: the servers generate while the trainer trains under "
                "async.max_staleness > 0, so their memory is never free to release"
            )

    @property
    def pipelined(self) -> bool:
        """Generation runs beside training (async.max_staleness > 0), not in turns with it."""
        return self.async_.max_staleness > 0

    @property
    def generation_lag(self) -> int:
        """How many steps generation runs ahead of training: the staleness bound, less the one version a
        partial sample gains when it continues in the next step."""
        return self.async_.max_staleness - (1 if self.partial.enabled else 0)
