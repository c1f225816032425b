"""The one YAML file that configures every detector and the action policy.

Every field has a documented default (``runwatch config --defaults`` prints them);
unknown keys are rejected so that a typo does not silently fall back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NonFiniteConfig(Strict):
    enabled: bool = True
    max_consecutive: int = Field(
        default=3, ge=1, description="non-finite steps in a row before the finding turns critical (rollback)"
    )


class SpikeConfig(Strict):
    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps of history for the rolling median / IQR")
    warmup: int = Field(default=20, ge=4, description="steps observed before any finding")
    z_threshold: float = Field(default=6.0, gt=0, description="robust z of log(value) that counts as a spike")
    critical_z: float = Field(default=12.0, gt=0, description="robust z above which the spike is critical")
    min_ratio: float = Field(default=2.0, ge=1.0, description="value / rolling median must also reach this")
    min_scale: float = Field(
        default=0.05, gt=0, description="floor on the robust scale in log units (a very flat series is not a hair trigger)"
    )
    cooldown_steps: int = Field(default=5, ge=0, description="steps after a finding before the next one")

    @model_validator(mode="after")
    def _warmup_fits(self) -> SpikeConfig:
        if self.warmup > self.window:
            raise ValueError(f"warmup ({self.warmup}) must not exceed window ({self.window})")
        if self.critical_z < self.z_threshold:
            raise ValueError("critical_z must be at least z_threshold")
        return self


class DetectorsConfig(Strict):
    non_finite: NonFiniteConfig = NonFiniteConfig()
    loss_spike: SpikeConfig = SpikeConfig()
    grad_norm_spike: SpikeConfig = SpikeConfig()


ActionName = Literal["alert", "pause", "rollback", "stop"]


class PolicyRule(Strict):
    detector: str = Field(default="*", description="detector name, or * for any")
    min_severity: Literal["info", "warning", "critical"] = "warning"
    action: ActionName


class PolicyConfig(Strict):
    rules: list[PolicyRule] = Field(
        default_factory=lambda: [
            PolicyRule(detector="non_finite", min_severity="critical", action="rollback"),
            PolicyRule(detector="*", min_severity="warning", action="alert"),
        ],
        description="first matching rule wins",
    )
    cooldown_s: float = Field(default=60.0, ge=0, description="same action for the same detector, at most once per")
    max_rollbacks: int = Field(default=3, ge=0, description="after this many rollbacks a rollback becomes a stop")
    action_ttl_s: float = Field(default=120.0, gt=0, description="actions expire this long after issue")


class RunwatchConfig(Strict):
    detectors: DetectorsConfig = DetectorsConfig()
    policy: PolicyConfig = PolicyConfig()


class ConfigError(ValueError):
    pass


def load_config(path: str | Path | None = None) -> RunwatchConfig:
    """Read and validate a YAML config; ``None`` gives the defaults."""
    if path is None:
        return RunwatchConfig()
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text (UTF-8) file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    try:
        return RunwatchConfig.model_validate(data)
    except ValidationError as exc:
        lines = [f"  {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(f"invalid config {path}:\n" + "\n".join(lines)) from None


def defaults_yaml() -> str:
    return yaml.safe_dump(RunwatchConfig().model_dump(mode="json"), sort_keys=False)
