"""Every detector a run's monitor drives, by name (the registry's order), and which view each reads.

The model's health is one for the whole run, so it is judged on the joined step (one finding, not one per
rank); the machine's (throughput, data, memory, liveness, a NaN on one rank) is each rank's own. In a
single-rank run both views are its rank. Cross-rank detectors (straggler, hung rank) compare ranks: every
rank's events, then each joined step's record, in runs of more than one rank.
"""

from __future__ import annotations

from collections.abc import Callable

from runwatch.detectors import registry
from runwatch.detectors.base import Detector
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.progress import RunProgress


def _builder(spec: registry.DetectorSpec) -> Callable[[RunwatchConfig, RunProgress], Detector]:
    return lambda config, progress: spec.make(config.detectors, progress)


DETECTORS: dict[str, Callable[[RunwatchConfig, RunProgress], Detector]] = {
    s.name: _builder(s) for s in registry.specs()
}
JOINED_VIEW = frozenset(registry.names("joined"))
CROSS_RANK_VIEW = frozenset(registry.names("cross_rank"))
RANK_VIEW = frozenset(DETECTORS) - JOINED_VIEW - CROSS_RANK_VIEW


def build_detectors(config: RunwatchConfig, names: frozenset[str], progress: RunProgress) -> list[Detector]:
    """The enabled detectors of ``names`` (a view), new, in the registry's order."""
    return [
        make(config, progress)
        for name, make in DETECTORS.items()
        if name in names and getattr(config.detectors, name).enabled
    ]
