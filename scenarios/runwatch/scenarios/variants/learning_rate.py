"""Harder corpus variants: LR and update-ratio faults (a milder LR error, a gradual LR ramp, a planned LR
ramp-up) and the gradual loss rise.
"""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
