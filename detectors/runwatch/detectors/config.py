"""The one YAML file that configures every detector and the action policy.

Every field has a documented default (``runwatch config --defaults`` prints them);
unknown keys are rejected so that a typo does not silently fall back to a default.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, create_model, field_validator, model_validator

from runwatch.contract.action_kinds import PolicyActionKind
from runwatch.contract.schema import Severity, WireLimits
from runwatch.detectors.configfile import (
    ConfigError as ConfigError,  # re-exported: callers catch it from here
)
from runwatch.detectors.configfile import load_yaml_model
from runwatch.detectors.plugins import load_plugins
from runwatch.detectors.registry import BUILTIN_MODULES, Strict, known_finding_names, specs

# The built-in detectors register themselves on import; their config sections are defined beside them.
# Installed packages add theirs through the entry-point group `runwatch.detectors` (plugins.py), loaded
# here too: the config model is built from the registry, so every detector is in it first
# (docs/detectors.md).
for _module in BUILTIN_MODULES:
    importlib.import_module(_module)
load_plugins()

# Re-exported from where they now live, for callers that import them from here.
from runwatch.detectors.activations import ActivationsConfig as ActivationsConfig  # noqa: E402
from runwatch.detectors.baseline_trajectory import BaselineTrajectoryConfig as BaselineTrajectoryConfig  # noqa: E402
from runwatch.detectors.baselines.compare import BaselineConfig as BaselineConfig  # noqa: E402
from runwatch.detectors.category import CategoryConfig as CategoryConfig  # noqa: E402
from runwatch.detectors.data_wait import DataWaitConfig as DataWaitConfig  # noqa: E402
from runwatch.detectors.engine.recovery import RecoveryConfig as RecoveryConfig  # noqa: E402
from runwatch.detectors.eval_category import EvalCategoryConfig as EvalCategoryConfig  # noqa: E402
from runwatch.detectors.frozen_modules import FrozenModulesConfig as FrozenModulesConfig  # noqa: E402
from runwatch.detectors.generalization import GeneralizationConfig as GeneralizationConfig  # noqa: E402
from runwatch.detectors.hung_rank import HungRankConfig as HungRankConfig  # noqa: E402
from runwatch.detectors.memory_growth import MemoryConfig as MemoryConfig  # noqa: E402
from runwatch.detectors.module_grad import ModuleGradConfig as ModuleGradConfig  # noqa: E402
from runwatch.detectors.nonfinite import NonFiniteConfig as NonFiniteConfig  # noqa: E402
from runwatch.detectors.optimizer_swap import OptimizerSwapConfig as OptimizerSwapConfig  # noqa: E402
from runwatch.detectors.param_norm import ParamNormConfig as ParamNormConfig  # noqa: E402
from runwatch.detectors.replica_divergence import ReplicaDivergenceConfig as ReplicaDivergenceConfig  # noqa: E402
from runwatch.detectors.skipped_updates import SkippedUpdatesConfig as SkippedUpdatesConfig  # noqa: E402
from runwatch.detectors.spike import SpikeConfig as SpikeConfig  # noqa: E402
from runwatch.detectors.stall import StallConfig as StallConfig  # noqa: E402
from runwatch.detectors.straggler import StragglerConfig as StragglerConfig  # noqa: E402
from runwatch.detectors.throughput import ThroughputConfig as ThroughputConfig  # noqa: E402
from runwatch.detectors.update_ratio import UpdateRatioConfig as UpdateRatioConfig  # noqa: E402
from runwatch.detectors.val_train_gap import ValTrainGapConfig as ValTrainGapConfig  # noqa: E402


def detectors_config_model() -> type[Strict]:
    """The ``detectors:`` section: one field per registered detector, its config beside its code."""
    fields: dict[str, Any] = {
        s.name: (s.config, Field(default_factory=s.default_section, description=s.summary)) for s in specs()
    }
    return create_model("DetectorsConfig", __base__=Strict, **fields)


if TYPE_CHECKING:

    class DetectorsConfig(Strict):
        """What the type checker sees of the registry-built model: the sections the code reads by name
        (every other section is read with ``getattr``, by its registered name)."""

        loss_spike: SpikeConfig = Field(default_factory=SpikeConfig)
        grad_norm_spike: SpikeConfig = Field(default_factory=SpikeConfig)
        stall: StallConfig = Field(default_factory=StallConfig)
        straggler: StragglerConfig = Field(default_factory=StragglerConfig)
        hung_rank: HungRankConfig = Field(default_factory=HungRankConfig)
        baseline_trajectory: BaselineTrajectoryConfig = Field(default_factory=BaselineTrajectoryConfig)
else:
    DetectorsConfig = detectors_config_model()


class JoinConfig(Strict):
    """The per-step join of a run's ranks in the worker."""

    timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a step is joined without the ranks that have not reported it this long "
        "after the first did (and those ranks are not waited for until they report)",
    )


class RunsConfig(Strict):
    """How long a worker holds a run that says nothing more, and how many it holds at most (a run that
    never sends run_end, a crashed job, must not hold memory forever; docs/state.md, "Run lifecycle")."""

    silence_retention_s: float = Field(
        default=6 * 3600.0,
        gt=0,
        description="a run with no event for this long is let go, with an info finding "
        "that it went silent (hours past the stall detector's silence and idle "
        "allowance, which alert long before)",
    )
    max_runs: int = Field(
        default=5_000,
        ge=1,
        description="runs one worker holds at most (40-250 KB each for one rank, by its events); past it "
        "a run is let go, with an info finding saying why: first those that never sent a step, then those "
        "not active within active_s, then active ones without a confirmed-good checkpoint, the least "
        "recently active first",
    )
    active_s: float = Field(
        default=300.0,
        gt=0,
        description="a run with an event this recent is active: past max_runs an active run that has sent a "
        "step is let go only when no run that never stepped or went quiet is held",
    )
    ledger_retention_s: float = Field(
        default=24 * 3600.0,
        ge=0,
        description="a run let go without its end (silence, eviction) keeps its checkpoint ledger, rollback "
        "count and attempt this long (a small record on runwatch.state): back within it, its next fault "
        "still rolls back to its confirmed-good checkpoint",
    )
    max_ledgers: int = Field(
        default=10_000,
        ge=0,
        description="ledgers of runs let go one worker keeps at most (about 1 KB each); past it the oldest "
        "goes",
    )
    budget_events_per_s: float = Field(
        default=2_000.0,
        ge=0,
        description="events one run may send per second, as the worker sees its partition's log grow; "
        "beyond it (and its burst) they are shed, never judged, and reported, so that one run's flood "
        "cannot starve the other runs of its partition (worker/runwatch/worker/run_budget.py). "
        "A backlog already in the log when the worker reads it is never shed. 0: no budget",
    )
    budget_burst_events: int = Field(
        default=4_000, ge=1, description="events one run may send at once above budget_events_per_s"
    )
    new_runs_per_s: float = Field(
        default=50.0,
        gt=0,
        description="run ids a partition has not seen that it admits per second (bursts of new_runs_burst): "
        "a flood of made-up run ids is shed too",
    )
    new_runs_burst: int = Field(default=500, ge=1, description="new run ids a partition admits at once")


class PolicyRule(Strict):
    detector: str = Field(default="*", description="detector name, or * for any")
    min_severity: Severity = "warning"
    action: PolicyActionKind

    @field_validator("detector")
    @classmethod
    def _known_detector(cls, name: str) -> str:
        known = known_finding_names()
        if name != "*" and name not in known:
            raise ValueError(f"unknown detector {name!r}; known: *, {', '.join(known)}")
        return name


def default_rules() -> list[PolicyRule]:
    """Roll back what will not heal on its own; alert on the rest (docs/remediation.md says why)."""
    return [
        PolicyRule(detector="non_finite", min_severity="critical", action="rollback"),
        # the trainer's guard skipped rollback_after updates in a row: it holds the run, it cannot heal it
        PolicyRule(detector="skipped_updates", min_severity="critical", action="rollback"),
        # critical: a divergence (the spike did not come back) or a huge spike; a transient one is a warning
        PolicyRule(detector="loss_spike", min_severity="critical", action="rollback"),
        PolicyRule(detector="grad_norm_spike", min_severity="critical", action="rollback"),
        PolicyRule(detector="not_recovered", min_severity="warning", action="rollback"),
        PolicyRule(detector="*", min_severity="warning", action="alert"),
    ]


# -- crashes (issue 39) ---------------------------------------------------------------------------------
# What a crash's class becomes: a restart without the failing host (exclude_host), a restart as it was
# (as_was), a stop, or nothing but the finding (none). docs/launch.md says why each.
CrashAction = Literal["exclude_host", "as_was", "stop", "none"]


def default_crash_actions() -> dict[str, CrashAction]:
    return {
        "collective_timeout": "exclude_host",  # a peer or the fabric failed: run elsewhere
        "hardware": "exclude_host",  # Xid, ECC, a device lost: never on that host again
        "segfault": "exclude_host",  # on a GPU node mostly a driver or a device; a repeat stops it
        "oom_host": "exclude_host",  # a node whose memory others share, or leaks; a repeat stops it
        "oom_device": "stop",  # the model does not fit its device: a restart OOMs again
        "preemption": "as_was",  # the scheduler took the node: the run is fine
        "dataloader": "as_was",  # a worker or a file system hiccup; a repeat stops it
        "unknown": "as_was",  # nothing says it will happen again; a repeat stops it
        "nonfinite_stop": "stop",  # the model diverged: a restart replays it
        "user_code": "stop",  # a bug: a restart hits it again
    }


class CrashPolicyConfig(Strict):
    """What a crash becomes (docs/launch.md#what-a-crash-becomes)."""

    actions: dict[str, CrashAction] = Field(
        default_factory=default_crash_actions, description="crash class -> exclude_host, as_was, stop, none"
    )
    settle_s: float = Field(
        default=3.0,
        ge=0,
        description="in a run of several ranks, how long after its first crash the others' are gathered "
        "before the cause is named (the earliest death) and acted on",
    )
    max_identical: int = Field(
        default=2,
        ge=1,
        description="the same class at the same step this many times (over the run's attempts): stop, "
        "never one more restart",
    )
    max_restarts: int = Field(default=10, ge=0, description="restarts of one run at most; then a stop")

    @field_validator("actions")
    @classmethod
    def _known_classes(cls, actions: dict[str, CrashAction]) -> dict[str, CrashAction]:
        from runwatch.detectors.crash_classes import CRASH_CLASSES

        unknown = sorted(set(actions) - set(CRASH_CLASSES))
        if unknown:
            raise ValueError(
                f"unknown crash class(es) {', '.join(unknown)}; known: {', '.join(CRASH_CLASSES)}"
            )
        return {**default_crash_actions(), **actions}


class PolicyConfig(Strict):
    rules: list[PolicyRule] = Field(default_factory=default_rules, description="first matching rule wins")
    alert_only: bool = Field(
        default=False, description="true: every rule's action is an alert (runwatch never acts on the run)"
    )
    confirm_steps: int = Field(
        default=20,
        ge=1,
        description="healthy steps after a checkpoint, with no finding of a detector that can "
        "trigger a rollback, before a rollback may restore it",
    )
    no_good_checkpoint: Literal["pause", "stop"] = Field(
        default="stop",
        description="what a rollback becomes when no confirmed-good checkpoint precedes the fault",
    )
    recovery: RecoveryConfig = RecoveryConfig()
    cooldown_s: float = Field(
        default=60.0, ge=0, description="same action for the same detector, at most once per"
    )
    max_rollbacks: int = Field(
        default=3, ge=0, description="after this many rollbacks a rollback becomes a stop"
    )
    action_ttl_s: float = Field(default=120.0, gt=0, description="actions expire this long after issue")
    ack_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="an action with no action_ack from any rank this long after issue: an "
        "action_unacknowledged finding (the trainer's listener is not running or refuses the signature)",
    )
    lr_scale_on_rollback: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="each rollback multiplies the LR by this (cumulative: 0.5, 0.25, ...)",
    )
    skip_data_window: bool = Field(
        default=True,
        description="a rollback tells the trainer to skip the batches from the checkpoint to the anomaly "
        "(the data goes on forward: a fault tied to a batch is not replayed)",
    )
    lr_restore_after_steps: int | None = Field(
        default=500,
        ge=1,
        description="healthy steps after a rollback before its LR scale starts back to 1 (null: never)",
    )
    lr_restore_over_steps: int = Field(
        default=100, ge=1, description="steps over which a rollback's LR scale returns to 1"
    )
    crash: CrashPolicyConfig = CrashPolicyConfig()
    escalate_after_s: float = Field(
        default=600.0,
        ge=0,
        description="a detector still alerting this long after its first alert: stop (0: off)",
    )


class RunwatchConfig(Strict):
    detectors: DetectorsConfig = DetectorsConfig()
    join: JoinConfig = JoinConfig()
    runs: RunsConfig = RunsConfig()
    policy: PolicyConfig = PolicyConfig()
    # What the worker accepts from the telemetry topic (docs/wire-format.md); the rest is dead-lettered.
    limits: WireLimits = WireLimits()
    # How a run is judged against its job's history (detectors/runwatch/detectors/baselines/,
    # docs/baselines.md).
    baseline: BaselineConfig = BaselineConfig()

    @model_validator(mode="after")
    def _confirmation_covers_divergence(self) -> RunwatchConfig:
        # A checkpoint confirmed before a divergence can be found might already hold the fault.
        delay = max(
            self.detectors.loss_spike.divergence_steps, self.detectors.grad_norm_spike.divergence_steps
        )
        if self.policy.confirm_steps <= delay:
            raise ValueError(
                f"policy.confirm_steps ({self.policy.confirm_steps}) must exceed the spike detectors' "
                f"divergence_steps ({delay}): a checkpoint is confirmed only after a divergence could "
                "have been found"
            )
        return self


def load_config(path: str | Path | None = None) -> RunwatchConfig:
    """Read and validate a YAML config; ``None`` gives the defaults."""
    return RunwatchConfig() if path is None else load_yaml_model(path, RunwatchConfig)


def defaults_yaml() -> str:
    return yaml.safe_dump(RunwatchConfig().model_dump(mode="json"), sort_keys=False)
