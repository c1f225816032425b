"""Per-category spread (issue 37, item 5): the sum of squares and the tail count that ride with each
category's mean, computed on the device, carried through the cross-rank join and merged exactly."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
import torch

from runwatch.contract.group_report import StepPartial
from runwatch.contract.schema import CategoryLoss, StepEvent
from runwatch.detectors.category import CategoryConfig, CategoryDivergenceDetector
from runwatch.detectors.engine.step_partial import joined_fields, merge, partial_of
from runwatch.producer.instrument.categories import TAIL_QUANTILE, category_loss

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def reference(
    losses: list[float], labels: list[str], weights: list[float] | None = None
) -> dict[str, tuple[float, int, float, int]]:
    """Plain Python: (weighted mean, count, count x weighted mean square, samples above the batch's
    TAIL_QUANTILE) per category."""
    w = weights or [1.0] * len(losses)
    ordered = sorted(losses)
    pos = TAIL_QUANTILE * (len(ordered) - 1)  # linear interpolation, as torch.quantile
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    cut = ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    out = {}
    for name in dict.fromkeys(labels):
        idx = [i for i, c in enumerate(labels) if c == name]
        ws = sum(w[i] for i in idx)
        mean = sum(w[i] * losses[i] for i in idx) / ws
        square = sum(w[i] * losses[i] ** 2 for i in idx) / ws
        out[name] = (mean, len(idx), len(idx) * square, sum(1 for i in idx if losses[i] > cut))
    return out


def check(got: dict[str, CategoryLoss], want: dict[str, tuple[float, int, float, int]]) -> None:
    assert set(got) == set(want)
    for name, (mean, count, sumsq, tail) in want.items():
        c = got[name]
        assert c.mean == pytest.approx(mean, rel=1e-6)
        assert c.count == count
        assert c.sumsq == pytest.approx(sumsq, rel=1e-6)
        assert c.tail_count == tail
        assert c.sumsq is not None and c.sumsq / c.count - c.mean**2 >= -1e-9  # a variance


def test_spread_matches_a_plain_reference_unweighted_and_weighted():
    g = torch.Generator().manual_seed(3)
    losses = torch.rand(64, generator=g, dtype=torch.float64) * 3
    labels = [("a", "b", "c", "rare")[int(i)] for i in torch.randint(0, 4, (64,), generator=g)]
    weights = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
    lengths = torch.randint(1, 50, (64,), generator=g)
    ls = losses.tolist()
    check(category_loss(losses, labels).resolve(), reference(ls, labels))
    check(category_loss(losses, labels, weights=weights).resolve(), reference(ls, labels, weights.tolist()))
    check(
        category_loss(losses, labels, lengths=lengths).resolve(),
        reference(ls, labels, [float(v) for v in lengths.tolist()]),
    )
    # without weights the variance is the plain one of the category's per-sample losses
    got = category_loss(losses, labels).resolve()["a"]
    a = losses[[i for i, c in enumerate(labels) if c == "a"]]
    assert got.sumsq / got.count - got.mean**2 == pytest.approx(a.var(unbiased=False).item(), rel=1e-6)
    # a tenth of the batch is the tail: 7 of 64 above the 90th percentile (its rank is 56.7)
    total_tail = sum(c.tail_count or 0 for c in category_loss(losses, labels).resolve().values())
    assert total_tail == 7


def test_micro_batches_add_their_spread_each_above_its_own_quantile():
    first = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 5.0])
    second = torch.tensor([1.0, 1.0, 9.0])
    a = category_loss(first, ["x"] * 9 + ["y"])
    b = category_loss(second, ["y", "x", "z"])
    total = (a + b).resolve()
    assert total["y"].tail_count == 1 and total["z"].tail_count == 1 and total["x"].tail_count == 0
    xs = first[:9].tolist() + [1.0]
    assert total["x"].sumsq == pytest.approx(sum(v * v for v in xs))
    assert total["x"].count == 10


def test_ties_and_empty_batches_put_nothing_in_the_tail():
    flat = category_loss(torch.zeros(8), ["a"] * 8).resolve()
    assert flat["a"].tail_count == 0 and flat["a"].sumsq == 0.0
    assert category_loss(torch.zeros(0), []).resolve() == {}


def test_the_wire_stays_compatible_without_the_spread():
    old = CategoryLoss.model_validate({"mean": 2.1, "count": 64})
    assert old.sumsq is None and old.tail_count is None
    assert b"sumsq" not in StepEvent(run_id="r", rank=0, step=1, ts=T0, category_loss={"a": old}).to_json()
    with pytest.raises(ValueError):
        CategoryLoss.model_validate({"mean": 2.1, "count": 4, "tail_count": -1})


def rank_event(rank: int, losses: torch.Tensor, labels: list[str]) -> StepEvent:
    return StepEvent(
        run_id="r",
        rank=rank,
        step=7,
        ts=T0,
        loss=float(losses.mean()),
        category_loss=category_loss(losses, labels).resolve(),
    )


def test_merging_two_halves_equals_one_join_and_keeps_the_variance_exact():
    g = torch.Generator().manual_seed(11)
    events = []
    all_losses: list[float] = []
    all_labels: list[str] = []
    for rank in range(4):
        losses = torch.rand(32, generator=g, dtype=torch.float64) * (1 + rank)
        labels = [("a", "b", "c")[int(i)] for i in torch.randint(0, 3, (32,), generator=g)]
        events.append(rank_event(rank, losses, labels))
        all_losses += losses.tolist()
        all_labels += labels
    whole = partial_of((0, 7), events, 4, [])
    halves = merge([partial_of((0, 7), events[2:], 2, []), partial_of((0, 7), events[:2], 2, [])], 4)
    assert set(halves.category_spread) == set(whole.category_spread) == {"a", "b", "c"}
    for name, (squares, tail) in whole.category_spread.items():
        assert halves.category_spread[name][0] == pytest.approx(squares, rel=1e-12)
        assert halves.category_spread[name][1] == tail
        assert halves.categories[name][0] == pytest.approx(whole.categories[name][0], rel=1e-12)
    joined = joined_fields("r", halves)["category_loss"]
    for name in ("a", "b", "c"):
        values = torch.tensor([v for v, c in zip(all_losses, all_labels, strict=True) if c == name])
        c = joined[name]
        assert c.count == len(values)
        assert c.sumsq / c.count - c.mean**2 == pytest.approx(values.var(unbiased=False).item(), rel=1e-6)
        # each rank's tail is above its own batch's quantile; the join sums them
        assert c.tail_count == sum(
            e.category_loss[name].tail_count or 0 for e in events if name in e.category_loss
        )
    # a round trip through the group report's wire form keeps them
    back = StepPartial.model_validate_json(halves.model_dump_json())
    assert back.category_spread == halves.category_spread


def test_a_rank_without_the_spread_leaves_the_category_without_it():
    new = rank_event(0, torch.tensor([1.0, 2.0, 3.0]), ["a", "a", "b"])
    old = StepEvent(run_id="r", rank=1, step=7, ts=T0, category_loss={"a": CategoryLoss(mean=1.0, count=2)})
    assert set(partial_of((0, 7), [new, old], 2, []).category_spread) == {"b"}
    merged = merge([partial_of((0, 7), [new], 1, []), partial_of((0, 7), [old], 1, [])], 2)
    assert set(merged.category_spread) == {"b"}
    joined = joined_fields("r", merged)["category_loss"]
    assert joined["a"].sumsq is None and joined["a"].count == 4
    assert joined["b"].tail_count is not None


# -- the detector's spread test ---------------------------------------------------------------------------

NAMES = ["en", "de", "fr", "pt"]
SHARE = [0.5, 0.25, 0.17, 0.08]


def spread_run(
    fault: str | None, onset: int = 200, steps: int = 320, seed: int = 5, learn_until: int = 10**6
) -> list[StepEvent]:
    """A CNN-like run through the real ``category_loss``: three categories learn (their loss falls), 'pt'
    stays near chance with a wide per-sample spread (gamma, CV 0.7). ``fault``: 'labels' (from ``onset``
    a share of 'pt' growing to 21% over 100 steps scores like a wrong label, 3.5-4) or 'run' (every
    category 1.3x from ``onset``, as an LR bump)."""
    torch.manual_seed(seed)
    gamma = torch.distributions.Gamma(torch.tensor(2.0), torch.tensor(2.0))
    out = []
    for step in range(steps):
        cat = torch.multinomial(torch.tensor(SHARE), 64, replacement=True)
        learnt = 0.3 + 1.5 * math.exp(-min(step, learn_until) / 120)
        losses = torch.tensor([learnt, learnt * 1.1, learnt * 1.2, 1.7])[cat] * gamma.sample((64,))
        if fault == "labels" and step >= onset:
            share = 0.21 * min(1.0, (step - onset + 1) / 100)
            wrong = (cat == 3) & (torch.rand(64) < share)
            losses = torch.where(wrong, 3.5 + 0.5 * torch.rand(64), losses)
        if fault == "run" and step >= onset:
            losses = losses * 1.3
        cats = category_loss(losses, cat, names=NAMES).resolve()
        ts = T0 + timedelta(seconds=step)
        out.append(StepEvent(run_id="r", step=step, ts=ts, loss=float(losses.mean()), category_loss=cats))
    return out


def findings(events: list[StepEvent], **config: object) -> list:
    det = CategoryDivergenceDetector(CategoryConfig(**config))
    return [f for e in events for f in det.update(e, e.ts)]


def test_a_near_chance_category_whose_tail_grows_is_named():
    run = spread_run("labels")
    found = findings(run)
    assert found, "not found"
    f = found[0]
    assert f.evidence["category"] == "pt" and "'pt'" in f.message
    assert f.evidence["test"] == "spread" and f.severity == "warning"
    assert f.step > 200 and f.evidence["onset_step"] >= 200
    assert f.evidence["tail_share"] > f.evidence["typical_tail_share"]
    assert f.evidence["cusum"] >= f.evidence["cusum_threshold"]
    # without the spread on the wire (an older producer), or with the test off, the mean test alone
    # does not find it: the wrong labels move the near-chance category's mean 1.2-1.4x
    bare = [
        e.model_copy(
            update={
                "category_loss": {
                    k: CategoryLoss(mean=c.mean, count=c.count) for k, c in e.category_loss.items()
                }
            }
        )
        for e in run
    ]
    assert findings(bare) == []
    assert findings(run, spread=False) == []


def test_healthy_runs_with_a_near_chance_category_stay_quiet():
    for seed in (5, 6, 7, 8, 9):
        assert findings(spread_run(None, seed=seed)) == []
