"""Every detector declares itself once, here: its name, its config (defined beside its code), the
view it reads, whether its findings are episodic, and its main sensitivity knob.

Everything that used to repeat the names derives from this registry: the YAML config model
(``config.DetectorsConfig``), the monitor's wiring (``monitor.DETECTORS``, ``JOINED_VIEW``,
``RANK_VIEW``), the policy's episodic set, ``calibrate``'s knobs, the check that a policy rule
names a known detector, and the documented table of detectors (a test keeps docs/detectors.md
in step).

Views:

- ``rank``: each rank's own events (throughput, data, memory, liveness, a NaN on one rank);
- ``joined``: the run's joined step, one per step across ranks (the model's health);
- ``cross_rank``: compares ranks (straggler, hung rank): every rank's events, then each joined step's
  record (``base.CrossRankDetector``).

This module imports no detector: each detector module calls :func:`register` at import, and
``config`` imports the built-in ones (:data:`BUILTIN_MODULES`), then the installed plugins' (the
entry-point group ``runwatch.detectors``: detectors/runwatch/detectors/plugins.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from runwatch.detectors.configfile import (
    Strict as Strict,  # re-exported: every detector config derives from it
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from runwatch.detectors.base import Detector
    from runwatch.detectors.engine.progress import RunProgress

View = Literal["rank", "joined", "cross_rank"]


@dataclass(frozen=True)
class DetectorSpec:
    """One detector's declaration. ``build`` gets the whole ``detectors`` section (a detector may
    read a neighbour's, as the hung-rank detector reads the stall's phase allowances) and returns
    the detector; ``default`` makes its section's default (``config()`` unless the same code runs
    under two names with different defaults, as the loss and grad-norm spikes do)."""

    name: str
    config: type[Strict]
    build: Callable[..., Detector]
    view: View
    summary: str
    episodic: bool = False  # fires once per episode: what persists is escalated by the policy's tick
    knob: str | None = None  # calibrate's sensitivity knob (a field of ``config``)
    default: Callable[[], Strict] | None = None
    # A liveness detector reads the run's ``RunProgress`` (engine/progress.py), which the monitor keeps: its
    # ``build`` then takes that as a second argument (None: running alone, it keeps its own).
    reads_progress: bool = False
    # The fault kinds of the labelled scenario corpus this detector is the one to find (its name by
    # default; memory growth finds two, a leak and fragmentation; liveness detectors of the
    # cross-rank view have no single-run scenario).
    faults: tuple[str, ...] | None = None

    def make(self, detectors: BaseModel, progress: RunProgress) -> Detector:
        """The detector, for a run whose progress tracker is ``progress``."""
        return self.build(detectors, progress) if self.reads_progress else self.build(detectors)

    def fault_kinds(self) -> tuple[str, ...]:
        if self.faults is not None:
            return self.faults
        return () if self.view == "cross_rank" else (self.name,)

    def default_section(self) -> Strict:
        return self.default() if self.default is not None else self.config()


_REGISTRY: dict[str, DetectorSpec] = {}

# Findings the policy and the monitor produce (not a registered detector's), which rules may name too:
# a rollback that did (or did not) bring the run back, a run that ended outside its job's history
# (baselines/gate.py), an action no rank acknowledged in time (engine/ack_watch.py), and a rank whose clock
# is ahead of the worker's (engine/monitor.py, clock_seen).
POLICY_FINDINGS = (
    "not_recovered",
    "recovered",
    "baseline_outliers",
    "action_unacknowledged",
    "clock_skew",
    "crash",  # a rank crashed (issue 39: engine/crashes.py), classified; its action is the crash policy's
)

BUILTIN_MODULES = (
    "runwatch.detectors.nonfinite",
    "runwatch.detectors.skipped_updates",
    "runwatch.detectors.optimizer_swap",
    "runwatch.detectors.spike",
    "runwatch.detectors.module_grad",
    "runwatch.detectors.frozen_modules",
    "runwatch.detectors.activations",
    "runwatch.detectors.update_ratio",
    "runwatch.detectors.throughput",
    "runwatch.detectors.data_wait",
    "runwatch.detectors.memory_growth",
    "runwatch.detectors.category",
    "runwatch.detectors.generalization",
    "runwatch.detectors.val_train_gap",
    "runwatch.detectors.param_norm",
    "runwatch.detectors.eval_category",
    "runwatch.detectors.loss_rise",
    "runwatch.detectors.stall",
    "runwatch.detectors.straggler",
    "runwatch.detectors.hung_rank",
    "runwatch.detectors.replica_divergence",
    "runwatch.detectors.baseline_trajectory",
)


def register(spec: DetectorSpec) -> DetectorSpec:
    """Declare a detector; registering the same name again replaces it (a reloaded module)."""
    if spec.knob is not None and spec.knob not in spec.config.model_fields:
        raise ValueError(f"detector {spec.name}: knob {spec.knob!r} is not a field of {spec.config.__name__}")
    _REGISTRY[spec.name] = spec
    return spec


def registered() -> dict[str, DetectorSpec]:
    """Name -> spec of every registered detector (a copy)."""
    return dict(_REGISTRY)


def specs() -> list[DetectorSpec]:
    """Every registered detector, in registration order."""
    return list(_REGISTRY.values())


def spec(name: str) -> DetectorSpec:
    return _REGISTRY[name]


def names(view: View | None = None) -> list[str]:
    return [s.name for s in _REGISTRY.values() if view is None or s.view == view]


def detector_for_fault() -> dict[str, str]:
    """Fault kind of the scenario corpus -> the detector expected to find it."""
    return {fault: s.name for s in _REGISTRY.values() for fault in s.fault_kinds()}


def known_finding_names() -> list[str]:
    """What a policy rule may name besides ``*``."""
    return names() + list(POLICY_FINDINGS)
