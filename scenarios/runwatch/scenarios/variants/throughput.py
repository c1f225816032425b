"""Harder corpus variants: throughput creep and contention (a host saturated by other jobs from start to
end).
"""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
