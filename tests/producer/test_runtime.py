"""StepClock, the peak-FLOPs table and MFU: what the step event's step_time_s, data_wait_s and mfu are made
of."""

from __future__ import annotations

import math

import pytest
import torch

from runwatch.producer.instrument.runtime import (
    PEAK_FLOPS,
    StepClock,
    mfu,
    peak_flops,
    peak_flops_for_name,
    transformer_flops_per_step,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class SlowLoader:
    """Each batch takes ``fetch_s`` of (fake) time to produce."""

    def __init__(self, clock: FakeClock, batches: list[int], fetch_s: float):
        self.clock, self.batches, self.fetch_s = clock, batches, fetch_s

    def __iter__(self):
        for batch in self.batches:
            self.clock.advance(self.fetch_s)
            yield batch
        self.clock.advance(self.fetch_s)  # discovering the end also takes time


def test_lap_splits_step_time_into_data_wait_and_compute():
    clock = FakeClock()
    steps = StepClock(clock=clock)
    steps.start()
    laps = []
    for _batch in steps.wrap(SlowLoader(clock, [1, 2, 3], fetch_s=0.25)):
        clock.advance(1.0)  # compute
        laps.append(steps.lap())
    assert laps == [(1.25, 0.25)] * 3


def test_wrap_yields_every_item_in_order():
    steps = StepClock()
    assert list(steps.wrap(iter(["a", "b", "c"]))) == ["a", "b", "c"]
    assert list(steps.wrap([])) == []


def test_lap_before_start_has_no_step_time_and_then_starts():
    clock = FakeClock()
    steps = StepClock(clock=clock)
    assert steps.lap() == (None, 0.0)
    clock.advance(2.0)
    assert steps.lap() == (2.0, 0.0)


def test_lap_resets_the_data_wait():
    clock = FakeClock()
    steps = StepClock(clock=clock)
    steps.start()
    batches = steps.wrap(SlowLoader(clock, [1, 2], fetch_s=0.5))
    next(batches)
    assert steps.lap() == (0.5, 0.5)
    clock.advance(0.1)
    assert steps.lap() == (pytest.approx(0.1), 0.0)


def test_start_discards_wait_counted_before_it():
    clock = FakeClock()
    steps = StepClock(clock=clock)
    batches = steps.wrap(SlowLoader(clock, [1, 2], fetch_s=3.0))
    next(batches)  # e.g. the first batch fetched before training starts
    steps.start()
    clock.advance(1.0)
    assert steps.lap() == (1.0, 0.0)


def test_wait_at_loader_exhaustion_is_counted():
    clock = FakeClock()
    steps = StepClock(clock=clock)
    steps.start()
    for _ in steps.wrap(SlowLoader(clock, [1], fetch_s=0.5)):
        steps.lap()
    assert steps.lap() == (0.5, 0.5)


def test_callbacks_bracket_each_wait_including_the_last_and_a_failing_one():
    events = []
    steps = StepClock(on_wait_begin=lambda: events.append("begin"), on_wait_end=lambda: events.append("end"))
    for item in steps.wrap([1, 2]):
        events.append(item)
    assert events == ["begin", "end", 1, "begin", "end", 2, "begin", "end"]

    def broken_loader():
        yield 1
        raise OSError("worker died")

    events.clear()
    with pytest.raises(OSError):
        for item in steps.wrap(broken_loader()):
            events.append(item)
    assert events == ["begin", "end", 1, "begin", "end"]


@pytest.mark.parametrize(
    ("device_name", "expected_key"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA H200 NVL", "H200 NVL"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", "L40"),
        ("NVIDIA L4", "L4"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S"),
        ("Tesla T4", "T4"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("AMD Instinct MI300X", "MI300X"),
    ],
)
def test_device_names_map_to_their_own_entry(device_name, expected_key):
    assert peak_flops_for_name(device_name) == PEAK_FLOPS[expected_key]


def test_sxm_and_pcie_h100_differ_and_the_table_is_dense_not_sparse():
    assert peak_flops_for_name("NVIDIA H100 80GB HBM3") > peak_flops_for_name("NVIDIA H100 PCIe")
    assert PEAK_FLOPS["A100"] == 312e12  # the datasheet's 624 is with 2:4 sparsity


@pytest.mark.parametrize("device_name", ["NVIDIA RTX A4000", "NVIDIA GeForce GTX 1080", "Intel Arc", ""])
def test_unknown_names_have_no_peak_rather_than_a_neighbour_s(device_name):
    assert peak_flops_for_name(device_name) is None


def test_override_wins_and_cpu_has_no_peak():
    assert peak_flops("cpu", override=1e12) == 1e12
    assert peak_flops(override=5e14) == 5e14
    assert peak_flops("cpu") is None
    assert peak_flops("meta") is None
    assert peak_flops("not a device") is None


def test_no_cuda_in_use_means_no_peak():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is in use in this process")
    assert peak_flops() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_is_looked_up_by_name():
    name = torch.cuda.get_device_name(0)
    assert peak_flops("cuda:0") == peak_flops_for_name(name)
    assert peak_flops(0) == peak_flops_for_name(name)


def test_transformer_flops_is_six_n_tokens():
    assert transformer_flops_per_step(125_000_000, 4096) == 6 * 125_000_000 * 4096


def test_mfu_is_achieved_over_peak():
    flops = transformer_flops_per_step(1_000_000_000, 8192)  # 4.9152e13 FLOPs
    assert mfu(flops, 0.25, 312e12) == pytest.approx(flops / 0.25 / 312e12)
    assert 0 < mfu(flops, 0.25, 312e12) < 1


@pytest.mark.parametrize(
    "args",
    [
        (None, 1.0, 1e12),
        (1e12, None, 1e12),
        (1e12, 1.0, None),
        (1e12, 0.0, 1e12),
        (1e12, -1.0, 1e12),
        (0.0, 1.0, 1e12),
        (1e12, 1.0, 0.0),
        (1e12, math.nan, 1e12),
        (math.inf, 1.0, 1e12),
    ],
)
def test_mfu_is_absent_when_an_input_is_missing_or_not_positive(args):
    assert mfu(*args) is None
