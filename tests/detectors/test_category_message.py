"""category_divergence's finding reads in losses: the category's loss and its typical loss are losses a
person recognises (near the values fed in), not log-space levels that print as negative numbers."""

from __future__ import annotations

import math
import random
from datetime import UTC, datetime, timedelta

from runwatch.contract.schema import CategoryLoss, StepEvent
from runwatch.detectors.category import CategoryConfig, CategoryDivergenceDetector

T0 = datetime(2026, 11, 21, 9, 0, tzinfo=UTC)
BASE = {"web": 2.0, "code": 1.6, "math": 2.4, "wiki": 1.8}
WEIGHT = {"web": 4, "code": 2, "math": 1, "wiki": 2}


def events(onset: int = 300, steps: int = 400, to: float = 2.0, seed: int = 0) -> list[StepEvent]:
    """A flat run whose 'math' loss is multiplied by ``to`` from ``onset`` (per-sample CV 0.5)."""
    rng = random.Random(seed)
    names = list(BASE)
    out = []
    for step in range(steps):
        counts = dict.fromkeys(names, 0)
        for name in rng.choices(names, weights=[WEIGHT[n] for n in names], k=64):
            counts[name] += 1
        losses = {}
        for name, count in counts.items():
            if count:
                factor = to if name == "math" and step >= onset else 1.0
                mean = BASE[name] * factor * math.exp(rng.gauss(0, 0.5 / math.sqrt(count)))
                losses[name] = CategoryLoss(mean=mean, count=count)
        loss = sum(c.mean * c.count for c in losses.values()) / 64
        ts = T0 + timedelta(seconds=step)
        out.append(StepEvent(run_id="r", step=step, ts=ts, loss=loss, category_loss=losses))
    return out


def first_finding():
    det = CategoryDivergenceDetector(CategoryConfig())
    for event in events():
        found = det.update(event, event.ts)
        if found:
            return found[0]
    raise AssertionError("no finding")


def test_the_finding_names_the_category_and_prints_losses_not_log_levels():
    f = first_finding()
    assert f.evidence["category"] == "math" and "'math'" in f.message
    typical, loss = f.evidence["typical_loss"], f.value
    assert 0.8 * BASE["math"] < typical < 1.25 * BASE["math"]  # the category's own loss before the fault
    assert loss > 1.5 * typical and math.isclose(f.evidence["loss_ratio"], loss / typical)
    # the message prints those very losses and their ratio
    assert f"{loss:.4g} is {loss / typical:.2f}x its typical {typical:.4g}" in f.message
    assert "-" not in f.message.split("diverges:")[1].split("(")[0]  # no negative (log-space) values
