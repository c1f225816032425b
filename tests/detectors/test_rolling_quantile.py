"""``RollingQuantiles`` gives river's ``RollingQuantile`` numbers bit for bit, from one sorted window."""

from __future__ import annotations

import math
import pickle
import random

import pytest
from river import stats

from runwatch.detectors.rolling_quantile import RollingQuantiles

QS = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)


def same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 30, 100, 101])
@pytest.mark.parametrize("shape", ["gauss", "ties", "log"])
def test_same_numbers_as_river_while_filling_and_sliding(window, shape):
    rng = random.Random(window)
    draw = {
        "gauss": lambda: rng.gauss(0, 1) * 10 ** rng.randint(-3, 3),
        "ties": lambda: rng.choice([0.1, 0.2, 0.3, -0.0, 0.0, 1.0]),
        "log": lambda: math.log(rng.random() + 1e-300),
    }[shape]
    qs = (*QS, rng.random())
    river = {q: stats.RollingQuantile(q=q, window_size=window) for q in qs}
    mine = RollingQuantiles(window)
    for q in qs:
        assert mine.get(q) is None
    for i in range(3 * window + 20):
        x = draw()
        for r in river.values():
            r.update(x)
        mine.update(x)
        if i % 17 == 5:
            mine = pickle.loads(pickle.dumps(mine))
        quartiles = (river[0.25].get(), river[0.5].get(), river[0.75].get())
        assert all(same(a, b) for a, b in zip(mine.quartiles(), quartiles, strict=True)), i
        assert len(mine) == min(i + 1, window)
        assert same(mine.median(), river[0.5].get())
        for q, r in river.items():
            assert same(mine.get(q), r.get()), (i, q)


def test_window_must_hold_a_value():
    with pytest.raises(ValueError):
        RollingQuantiles(0)


def test_quartiles_are_the_three_gets():
    rng = random.Random(5)
    window = RollingQuantiles(20)
    for i in range(60):
        window.update(rng.gauss(0, 1))
        if i % 7 == 3:
            window = pickle.loads(pickle.dumps(window))
        assert window.quartiles() == (window.get(0.25), window.get(0.5), window.get(0.75))
        assert window.median() == window.get(0.5)


def test_the_median_of_an_empty_window_is_an_error():
    with pytest.raises(ValueError):
        RollingQuantiles(3).median()
