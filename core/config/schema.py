"""Validated configuration: Hydra composes a tree, these frozen pydantic models check it.

Unknown keys and bad values are errors that name the key (``ConfigError``). The ``model`` section is
validated by the chosen plugin's schema, a subclass of ``ModelConfig``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from pegainfer.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    """Which model to run. ``name`` is the registry name (``auto``: found from the checkpoint).

    ``path`` is a Hugging Face checkpoint folder; ``None`` selects the embedded tiny demo checkpoint.
    Plugins subclass this to add their own keys.
    """

    name: str = "auto"
    path: str | None = None
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    # "dummy": random weights of the real shapes instead of reading safetensors (benchmarks, smoke tests).
    load_format: Literal["auto", "dummy"] = "auto"


class CacheConfig(_Section):
    #: Tokens a KV page holds; None: the model's ``default_block_size`` (16 unless its plugin measured
    #: another faster).
    block_size: int | None = Field(default=None, ge=1, le=1024)
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    # Bytes the KV pool may use on the CPU, per tensor-parallel rank (there is no device memory to measure).
    cpu_kv_cache_bytes: int = Field(default=1 << 30, ge=1)
    # Fixed page count, bypassing the memory plan (tests force preemption with it).
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    #: Reuse the KV of a cached prompt prefix (full pages keyed by a chained hash of their tokens); a
    #: model that cannot (DeepSeek-V4) runs uncached and logs why once. vLLM's name.
    enable_prefix_caching: StrictBool = True
    #: Hybrid models (recurrent state beside attention): a state snapshot is kept at the last page boundary
    #: of every prompt and every this many pages (prefill chunks are cut there when caching is on).
    snapshot_interval_pages: int = Field(default=128, ge=1)
    #: State snapshots the memory plan reserves for prefix caching of hybrid models (None: as many as
    #: ``scheduler.max_num_seqs``, at most a tenth of the memory left after the state slots).
    num_state_snapshots: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _snapshots_need_caching(self) -> CacheConfig:
        if not self.enable_prefix_caching and self.num_state_snapshots:
            raise ValueError(
                "num_state_snapshots is set but enable_prefix_caching is false: snapshots only serve prefix "
                "caching (set cache.enable_prefix_caching=true or leave num_state_snapshots null)"
            )
        return self


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=4096, ge=1)
    # The longest prefill chunk one request may take in a step (None: the whole token budget).
    long_prefill_token_threshold: int | None = Field(default=None, ge=1)
    enable_chunked_prefill: bool = True


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(default=1, ge=1)
    #: Seconds a tensor-parallel rank waits for the others (joining, a collective, a step's plan) before
    #: the executor fails: a rank that dies or hangs fails the open requests instead of hanging them.
    timeout_s: float = Field(default=300.0, gt=0.0)


class SpeculativeConfig(_Section):
    """Speculative decoding: ``num_tokens`` draft tokens proposed per step for each greedy request (0:
    off), verified in the next forward. Greedy output is identical with and without it; sampled requests
    decode normally.

    ``method``: ``mtp`` drafts with the model's own draft layers (DeepSeek's and Qwen3.5's MTP modules);
    ``ngram`` (prompt lookup, any model) copies the tokens that followed the latest earlier occurrence of
    the request's last ``n`` tokens, for the longest ``n`` from ``prompt_lookup_max`` down to
    ``prompt_lookup_min`` that occurs (none found: no drafts that step).
    """

    num_tokens: int = Field(default=0, ge=0, le=16)
    method: Literal["mtp", "ngram"] = "mtp"
    prompt_lookup_min: int = Field(default=2, ge=1)
    prompt_lookup_max: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        return self

    @property
    def mtp_tokens(self) -> int:
        """Drafts a step from the model's draft layers (0 unless ``method`` is ``mtp``)."""
        return self.num_tokens if self.method == "mtp" else 0


class EngineConfig(_Section):
    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    #: Prefill-only steps of at most this many tokens (a prompt's tail after a prefix hit, short prompts)
    #: replay from CUDA graphs where the model supports it (``CausalLM.prefill_graph_tokens``); 0: never.
    prefill_graph_max_tokens: int = Field(default=128, ge=0)
    #: Schedule and launch step N+1 before step N's tokens are read back, so the host's work of a step
    #: runs beside the GPU's; None: on for CUDA devices. Needs device embedding and no speculation.
    async_scheduling: bool | None = None
    #: The installed model whose embedded tiny demo runs for ``model=auto`` with no ``model.path``: a
    #: setting like any default model, which the core's code does not otherwise know.
    demo_model: str = "qwen3_14b"

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value != "auto" and value.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return value


def validate_section(schema: type[BaseModel], data: Any, where: str) -> Any:
    """Build ``schema`` from ``data``; a failure becomes a ConfigError naming the dotted key."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, where)) from None


def format_validation_error(exc: ValidationError, where: str) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in (where, *err["loc"]) if p != "")
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key '{key}'")
        else:
            lines.append(f"invalid value for '{key}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)
