"""Harder corpus variants: category divergence (a near-chance category)."""

from __future__ import annotations

from runwatch.scenarios.scenario import Scenario

VARIANTS: tuple[Scenario, ...] = ()
