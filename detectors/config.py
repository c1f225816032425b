"""The one YAML file that configures every detector and the action policy.

Every field has a documented default (``runwatch config --defaults`` prints them);
unknown keys are rejected so that a typo does not silently fall back to a default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from runwatch.configfile import ConfigError as ConfigError  # re-exported: callers catch it from here
from runwatch.configfile import load_yaml_model
from runwatch.producer.schema import WireLimits


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
    critical_z: float = Field(default=12.0, gt=0, description="robust z above which the spike is critical ...")
    critical_ratio: float = Field(
        default=10.0, ge=1.0, description="... and value / rolling median reaches this (the default policy rolls back)"
    )
    min_ratio: float = Field(default=2.0, ge=1.0, description="value / rolling median must also reach this")
    divergence_steps: int = Field(
        default=5, ge=0, description="steps after a spike watched for a divergence (0: no divergence findings)"
    )
    divergence_ratio: float = Field(
        default=1.5, gt=1.0, description="median of those steps / the pre-spike median at least this: diverging, "
                                         "a critical finding (else the spike was transient)"
    )
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


class ModuleGradConfig(Strict):
    """One module's gradient norm exploding while it stays a module-level, not run-level, event."""

    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps of per-module history for its typical norm")
    warmup: int = Field(default=20, ge=4, description="steps observed before any finding")
    z_threshold: float = Field(default=6.0, gt=0, description="robust z of log(module norm) against its own history")
    min_ratio: float = Field(default=5.0, ge=1.0, description="module norm / its typical norm must also reach this")
    min_share: float = Field(
        default=0.1, ge=0, le=1, description="the module's share of the squared global norm must reach this"
    )
    cooldown_steps: int = Field(default=20, ge=0, description="steps after a finding for that module before the next")


class UpdateRatioConfig(Strict):
    """Relative update norm (update / parameter norm) leaving its healthy band: vanishing or too large."""

    enabled: bool = True
    warmup: int = Field(default=5, ge=1, description="observations (update-norm steps) before any finding")
    window: int = Field(default=50, ge=4, description="observations of history for the run's typical ratio")
    factor: float = Field(default=10.0, gt=1, description="a ratio this many times above/below typical is out of band")
    low: float = Field(default=1e-6, gt=0, description="absolute floor: below it the updates have vanished")
    high: float = Field(default=1e-1, gt=0, description="absolute ceiling: above it the updates are too large")
    patience: int = Field(default=3, ge=1, description="consecutive out-of-band observations before a finding")
    cooldown_steps: int = Field(default=100, ge=0)


class ThroughputConfig(Strict):
    """A sustained level shift in step time (a slower run), not a single slow step."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps before any finding")
    delta: float = Field(default=0.01, gt=0, lt=1, description="ADWIN confidence parameter")
    min_change: float = Field(default=0.3, gt=0, description="relative change of the mean step time that counts")
    cooldown_steps: int = Field(default=100, ge=0)


class DataWaitConfig(Strict):
    """The data loader's share of step time growing: the input pipeline is becoming the bottleneck."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps before any finding")
    window: int = Field(default=30, ge=4, description="steps in the recent mean of the share")
    min_share: float = Field(default=0.25, ge=0, le=1, description="recent data-wait share of step time must reach this")
    min_increase: float = Field(default=0.15, ge=0, le=1, description="and exceed the run's baseline share by this")
    cooldown_steps: int = Field(default=100, ge=0)


class MemoryConfig(Strict):
    """Memory growth, leak (allocated grows) versus fragmentation (reserved - allocated grows), and time to the limit."""

    enabled: bool = True
    window: int = Field(default=100, ge=8, description="steps in the rolling slope")
    min_points: int = Field(
        default=100, ge=8, description="samples in the fit before any finding (outlasts the allocator's warm-up)"
    )
    min_growth: float = Field(
        default=0.1, gt=0, description="growth over the window, as a fraction of the current value, that counts"
    )
    min_r2: float = Field(default=0.6, ge=0, le=1, description="how straight the growth must be (a leak is steady)")
    warn_horizon_s: float = Field(default=3600.0, gt=0, description="warning if the limit is projected within this")
    critical_horizon_s: float = Field(default=600.0, gt=0, description="critical if projected within this")
    cooldown_steps: int = Field(default=200, ge=0)

    @model_validator(mode="after")
    def _points_fit(self) -> MemoryConfig:
        if self.min_points > self.window:
            raise ValueError(f"min_points ({self.min_points}) must not exceed window ({self.window})")
        if self.critical_horizon_s > self.warn_horizon_s:
            raise ValueError("critical_horizon_s must not exceed warn_horizon_s")
        return self


class CategoryConfig(Strict):
    """One data category's loss diverging while the mean loss still looks fine."""

    enabled: bool = True
    warmup: int = Field(default=30, ge=4, description="steps with the category before any finding")
    window: int = Field(default=100, ge=8, description="steps of history for the category's typical loss")
    z_threshold: float = Field(
        default=3.0, gt=0, description="robust z of the category's log loss (patience makes 3 a rare streak by chance)"
    )
    min_ratio: float = Field(default=1.5, ge=1.0, description="category loss / its typical loss must also reach this")
    patience: int = Field(default=5, ge=1, description="consecutive observations above the threshold (not one noisy batch)")
    min_count: int = Field(
        default=16, ge=1, description="samples pooled, across steps if need be, into one observation of a category"
    )
    cooldown_steps: int = Field(default=100, ge=0)


class GeneralizationConfig(Strict):
    """Validation loss worsening while training loss keeps improving (overfitting, a leak in the eval data...)."""

    enabled: bool = True
    min_evals: int = Field(default=3, ge=2, description="evals before any finding")
    patience: int = Field(default=2, ge=1, description="consecutive evals with val worse than its best")
    min_rel_increase: float = Field(default=0.02, ge=0, description="val above its best by this fraction")
    train_window: int = Field(default=50, ge=4, description="steps in the train-loss means compared across evals")


class StallConfig(Strict):
    """Heartbeats go on but the step does not move (phase-aware), or heartbeats stop."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1, description="stalled after this many median step intervals ...")
    min_steps: int = Field(default=10, ge=2, description="steps seen before the median interval is trusted")
    phase_allowance_s: dict[str, float] = Field(
        default_factory=lambda: {"train": 10.0, "dataload": 60.0, "eval": 900.0, "checkpoint": 900.0, "idle": 3600.0},
        description="... plus this many seconds for the phase of the latest heartbeat (train: more than the "
                    "producer's 5 s heartbeat period, so a pause is reported as an eval or data wait in time)",
    )
    heartbeat_timeout_s: float = Field(
        default=30.0, gt=0, description="no event at all for at least this long: the rank is silent (dead)"
    )
    heartbeat_misses: float = Field(
        default=6.0, gt=1, description="... or for this many of the rank's heartbeat periods (its heartbeats' "
                                       "interval_s), where that is longer"
    )

    def silent_after_s(self, heartbeat_interval_s: float | None) -> float:
        """How long a rank whose heartbeats come every ``heartbeat_interval_s`` may go unheard."""
        if heartbeat_interval_s is None:
            return self.heartbeat_timeout_s
        return max(self.heartbeat_timeout_s, self.heartbeat_misses * heartbeat_interval_s)


class StragglerConfig(Strict):
    """One rank consistently slower than its peers (scored as NVIDIA's straggler detector does)."""

    enabled: bool = True
    score_threshold: float = Field(
        default=0.75, gt=0, lt=1, description="fastest rank's median step work / this rank's below this: a straggler"
    )
    window: int = Field(default=50, ge=4, description="steps in each rank's rolling median")
    min_steps: int = Field(default=10, ge=2, description="steps of a rank before it is scored")
    patience: int = Field(default=5, ge=1, description="joined steps in a row under the threshold before a finding")
    min_gap_s: float = Field(
        default=0.005, ge=0, description="and this rank's median is at least this much slower (tiny steps are noisy)"
    )


class HungRankConfig(Strict):
    """A rank that stops stepping while its heartbeat goes on, when its peers advance or wait on it."""

    enabled: bool = True
    factor: float = Field(default=3.0, gt=1, description="hung after this many median step intervals ...")
    phase_allowance_s: dict[str, float] = Field(
        default_factory=lambda: {"train": 10.0, "dataload": 60.0, "eval": 900.0, "checkpoint": 900.0, "idle": 3600.0},
        description="... plus this many seconds for the phase of the rank's latest heartbeat",
    )
    floor_s: float = Field(default=5.0, ge=0, description="and never sooner than this")
    min_steps: int = Field(default=5, ge=2, description="step intervals seen before the median is trusted")


class DetectorsConfig(Strict):
    non_finite: NonFiniteConfig = NonFiniteConfig()
    loss_spike: SpikeConfig = SpikeConfig()
    # grad norms are heavier-tailed than losses (an LR warm-up peak doubles them): a spike needs 3x
    grad_norm_spike: SpikeConfig = SpikeConfig(min_ratio=3.0)
    module_grad_explosion: ModuleGradConfig = ModuleGradConfig()
    update_ratio: UpdateRatioConfig = UpdateRatioConfig()
    throughput_drift: ThroughputConfig = ThroughputConfig()
    data_wait: DataWaitConfig = DataWaitConfig()
    memory_growth: MemoryConfig = MemoryConfig()
    category_divergence: CategoryConfig = CategoryConfig()
    val_vs_train: GeneralizationConfig = GeneralizationConfig()
    stall: StallConfig = StallConfig()
    straggler: StragglerConfig = StragglerConfig()
    hung_rank: HungRankConfig = HungRankConfig()


class JoinConfig(Strict):
    """The per-step join of a run's ranks in the worker."""

    timeout_s: float = Field(
        default=10.0, gt=0, description="a step is joined without the ranks that have not reported it this long "
                                        "after the first did (and those ranks are not waited for until they report)"
    )


ActionName = Literal["alert", "pause", "rollback", "stop"]


class PolicyRule(Strict):
    detector: str = Field(default="*", description="detector name, or * for any")
    min_severity: Literal["info", "warning", "critical"] = "warning"
    action: ActionName


class RecoveryConfig(Strict):
    """After a rollback, the run must return to its pre-fault loss (``detectors/recovery.py``)."""

    enabled: bool = True
    within_steps: int = Field(
        default=20, ge=1, description="the run must be back this many steps past the fault's onset, when it is judged"
    )
    judged_over: int = Field(default=5, ge=1, description="the median of the last this many steps' loss ratios")
    healthy_window: int = Field(default=20, ge=4, description="healthy steps before the onset that set the band")
    band_z: float = Field(default=3.0, gt=0, description="band: exp(band_z x robust scale of their log loss) ...")
    min_band: float = Field(default=0.1, ge=0, description="... and never tighter than 1 + this")

    @model_validator(mode="after")
    def _judged_fits(self) -> RecoveryConfig:
        if self.judged_over > self.within_steps:
            raise ValueError(f"judged_over ({self.judged_over}) must not exceed within_steps ({self.within_steps})")
        return self


def default_rules() -> list[PolicyRule]:
    """Roll back what will not heal on its own; alert on the rest (docs/remediation.md says why)."""
    return [
        PolicyRule(detector="non_finite", min_severity="critical", action="rollback"),
        # critical: a divergence (the spike did not come back) or a huge spike; a transient one is a warning
        PolicyRule(detector="loss_spike", min_severity="critical", action="rollback"),
        PolicyRule(detector="grad_norm_spike", min_severity="critical", action="rollback"),
        PolicyRule(detector="not_recovered", min_severity="warning", action="rollback"),
        PolicyRule(detector="*", min_severity="warning", action="alert"),
    ]


class PolicyConfig(Strict):
    rules: list[PolicyRule] = Field(default_factory=default_rules, description="first matching rule wins")
    alert_only: bool = Field(
        default=False, description="true: every rule's action is an alert (runwatch never acts on the run)"
    )
    confirm_steps: int = Field(
        default=20, ge=1, description="healthy steps after a checkpoint, with no finding of a detector that can "
                                      "trigger a rollback, before a rollback may restore it"
    )
    no_good_checkpoint: Literal["pause", "stop"] = Field(
        default="stop", description="what a rollback becomes when no confirmed-good checkpoint precedes the fault"
    )
    recovery: RecoveryConfig = RecoveryConfig()
    cooldown_s: float = Field(default=60.0, ge=0, description="same action for the same detector, at most once per")
    max_rollbacks: int = Field(default=3, ge=0, description="after this many rollbacks a rollback becomes a stop")
    action_ttl_s: float = Field(default=120.0, gt=0, description="actions expire this long after issue")
    lr_scale_on_rollback: float = Field(
        default=0.5, gt=0, le=1, description="each rollback multiplies the LR by this (cumulative: 0.5, 0.25, ...)"
    )
    skip_data_window: bool = Field(
        default=False, description="a rollback tells the trainer to skip the batches from the checkpoint to the anomaly"
    )
    escalate_after_s: float = Field(
        default=600.0, ge=0, description="a detector still alerting this long after its first alert: stop (0: off)"
    )


class RunwatchConfig(Strict):
    detectors: DetectorsConfig = DetectorsConfig()
    join: JoinConfig = JoinConfig()
    policy: PolicyConfig = PolicyConfig()
    # What the worker accepts from the telemetry topic (docs/wire-format.md); the rest is dead-lettered.
    limits: WireLimits = WireLimits()

    @model_validator(mode="after")
    def _confirmation_covers_divergence(self) -> RunwatchConfig:
        # A checkpoint confirmed before a divergence can be found might already hold the fault.
        delay = max(self.detectors.loss_spike.divergence_steps, self.detectors.grad_norm_spike.divergence_steps)
        if self.policy.confirm_steps <= delay:
            raise ValueError(f"policy.confirm_steps ({self.policy.confirm_steps}) must exceed the spike detectors' "
                             f"divergence_steps ({delay}): a checkpoint is confirmed only after a divergence could "
                             "have been found")
        return self


def load_config(path: str | Path | None = None) -> RunwatchConfig:
    """Read and validate a YAML config; ``None`` gives the defaults."""
    return RunwatchConfig() if path is None else load_yaml_model(path, RunwatchConfig)


def defaults_yaml() -> str:
    return yaml.safe_dump(RunwatchConfig().model_dump(mode="json"), sort_keys=False)
