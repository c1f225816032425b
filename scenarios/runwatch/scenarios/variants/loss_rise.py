"""Harder corpus variants: a training loss that rises slowly (an LR that creeps up every step) and its
benign look-alikes (a planned LR ramp-up, warm restarts).
"""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
