"""What the worker and the sink accept from the telemetry topic (``WireLimits``), and the bound a wire field
declares on itself (``Within``), which the limit checks read from the model."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from runwatch.contract.public_name import known_as_schema


@known_as_schema
@dataclass(frozen=True)
class Within:
    """The bound a wire field declares on itself, as its annotation's metadata
    (``step_time_s: Annotated[WireFloat | None, Within("max_duration_s")] = None``): finite, at least 0
    (above 0 with ``positive``) and at most ``limit``, the name of a ``WireLimits`` field (configurable) or
    a fixed number. A map's or a list's every value is held to it. The limit checks
    (``limit_checks.bounded_fields``) read the bounded fields from the model, so a new one is declared once,
    where it is defined."""

    limit: str | float
    positive: bool = False

    def upper(self, limits: WireLimits) -> float:
        if isinstance(self.limit, str):
            value: float = getattr(limits, self.limit)
            return value
        return self.limit


@known_as_schema
class WireLimits(BaseModel):
    """What the worker and the sink accept from the telemetry topic; anything outside is dead-lettered.

    One list, documented in docs/wire-format.md. Configurable under ``limits:`` in the worker's YAML.
    Times are checked against the *receive time*: the Kafka record's timestamp (the producing
    client's send time, or the broker's append time on a LogAppendTime topic), so that re-reading a
    backlog later gives the same verdicts.
    """

    model_config = ConfigDict(extra="forbid")

    max_message_bytes: int = Field(default=1_048_576, ge=1024, description="size of one message value")
    max_depth: int = Field(default=32, ge=4, le=512, description="nesting of JSON objects and arrays")
    max_string_chars: int = Field(default=4096, ge=64, description="any one string (names, uris, ids)")
    max_id_chars: int = Field(default=256, ge=16, description="run_id and event_id")
    max_modules: int = Field(
        default=10_000, ge=1, description="entries of module_grad_norms, of module_activations"
    )
    max_categories: int = Field(default=1_000, ge=1, description="entries of category_loss / per_category")
    max_metrics: int = Field(
        default=1_000, ge=1, description="entries of lr, metrics, summary, tags, gpu_names"
    )
    max_step: int = Field(default=10**12, ge=1, le=2**62, description="largest step number")
    max_world_size: int = Field(default=16_384, ge=1, le=10**6, description="largest world size; rank < this")
    max_duration_s: float = Field(
        default=7 * 86400.0, gt=0, description="step, data-wait, compute, phase times"
    )
    max_interval_s: float = Field(default=3600.0, gt=0, description="a heartbeat's declared period")
    max_memory_bytes: int = Field(default=2**50, ge=2**30, description="any memory figure (1 PiB)")
    max_rate: float = Field(default=1e12, gt=0, description="samples/s, tokens/s, a checkpoint's lr")
    max_evidence_bytes: int = Field(
        default=65_536, ge=4096, description="an evidence event as JSON (over it: truncated, never refused)"
    )
    max_evidence_threads: int = Field(default=64, ge=1, description="threads of an evidence event (...)")
    max_evidence_frames: int = Field(
        default=64, ge=1, description="frames per thread of an evidence event, the innermost kept (...)"
    )
    max_future_s: float = Field(default=300.0, ge=0, description="ts may be this far after the receive time")
    max_past_s: float = Field(
        default=7 * 86400.0, gt=0, description="ts may be this far before the receive time"
    )


DEFAULT_LIMITS = WireLimits()
