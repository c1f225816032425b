"""Harder corpus variants: validation worsening while training improves (noisier evals, after steep early
evals).
"""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
