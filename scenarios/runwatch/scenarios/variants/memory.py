"""Harder corpus variants: memory growth (leak, fragmentation) and its benign look-alikes (CPU RSS swings
around evals).
"""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
