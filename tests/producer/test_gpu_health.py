"""GPU health in the heartbeat (issue 38): the sampler on a fake NVML (figures, throttle decoding, at most
once a second per device, failure absent and logged once), the heartbeat carrying it, and a real CPU
training loop whose training thread makes no NVML call."""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch import nn

from runwatch.contract.schema import GpuHealth, HeartbeatEvent
from runwatch.producer.instrument.gpu_health import (
    THROTTLE_REASONS,
    GpuHealthSampler,
    decode_reasons,
    nvml_device_for,
    reason_bits,
)
from runwatch.producer.instrument.heartbeat import Heartbeat
from runwatch.producer.instrument.watch import Watcher
from tests.support.fake_nvml import HW_THERMAL, SW_POWER_CAP, SW_THERMAL, FakeDevice, FakeNvml


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sample_has_the_figures_in_the_wires_units_and_decoded_reasons():
    nvml = FakeNvml({0: FakeDevice(sm_clock=1110, reasons=SW_THERMAL | SW_POWER_CAP, ecc=(3, 1))})
    figures = GpuHealthSampler(0, nvml=nvml).sample()
    assert figures == {
        "device": 0,
        "util_pct": 97,
        "mem_util_pct": 40,
        "sm_clock_mhz": 1110,
        "sm_clock_max_mhz": 1980,
        "throttle_mask": SW_THERMAL | SW_POWER_CAP,
        "throttle_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
        "temperature_c": 65,
        "ecc_corrected": 3,
        "ecc_uncorrected": 1,
        "power_w": 650.0,  # (NVML's milliwatts)
        "power_limit_w": 700.0,
    }
    GpuHealth(**figures)  # within the wire's bounds
    assert nvml.count("nvmlInit") == 1


def test_the_reason_bits_decode_by_name_with_either_spelling_and_unknown_bits_as_other():
    assert decode_reasons(0) == []
    assert decode_reasons(HW_THERMAL | 0x1) == ["gpu_idle", "hw_thermal_slowdown"]
    assert decode_reasons(1 << 40) == ["other"]
    names = [name for name, _, _ in THROTTLE_REASONS]
    assert {
        "sw_power_cap",
        "hw_slowdown",
        "hw_thermal_slowdown",
        "sw_thermal_slowdown",
        "hw_power_brake",
    } <= set(names)

    class OldNvml:  # before NVML 12.535: only the "throttle" spelling
        nvmlClocksThrottleReasonSwThermalSlowdown = 0x20

    assert dict(reason_bits(OldNvml()))["sw_thermal_slowdown"] == 0x20
    assert all(len(n) <= 32 for n in names)


def test_a_device_is_sampled_at_most_once_a_second_and_each_device_on_its_own():
    nvml = FakeNvml({0: FakeDevice(), 1: FakeDevice(sm_clock=1500)})
    clock = FakeClock()
    first, second = GpuHealthSampler(0, nvml=nvml, clock=clock), GpuHealthSampler(1, nvml=nvml, clock=clock)
    assert first.sample()["sm_clock_mhz"] == 1980
    assert second.sample()["sm_clock_mhz"] == 1500
    nvml.devices[0].sm_clock = 1200
    clock.now += 0.6
    assert first.sample()["sm_clock_mhz"] == 1980  # the cached sample
    clock.now += 0.5
    assert first.sample()["sm_clock_mhz"] == 1200
    assert (first.samples, second.samples) == (2, 1)
    assert nvml.count("nvmlDeviceGetClockInfo") == 3


def test_no_driver_makes_the_sampler_absent_logged_once(caplog):
    nvml = FakeNvml(fail_init=True)
    clock = FakeClock()
    sampler = GpuHealthSampler(0, nvml=nvml, clock=clock)
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.instrument.gpu_health"):
        for _ in range(5):
            assert sampler.sample() is None
            clock.now += 2
    assert not sampler.active and "NVML unavailable" in (sampler.failed or "")
    assert len([r for r in caplog.records if "GPU health is off" in r.getMessage()]) == 1
    assert nvml.count("nvmlInit") == 1  # never asked again


def test_no_such_device_and_no_pynvml_are_absent_too(monkeypatch):
    assert GpuHealthSampler(3, nvml=FakeNvml()).sample() is None
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    sampler = GpuHealthSampler(0)
    assert sampler.sample() is None
    assert "runwatch[gpu]" in (sampler.failed or "")


def test_an_unsupported_figure_is_left_out_and_not_asked_again():
    nvml = FakeNvml({0: FakeDevice(ecc=None)})
    clock = FakeClock()
    sampler = GpuHealthSampler(0, nvml=nvml, clock=clock)
    for _ in range(3):
        figures = sampler.sample()
        assert figures is not None and "ecc_corrected" not in figures and "sm_clock_mhz" in figures
        clock.now += 1.5
    assert nvml.count("nvmlDeviceGetTotalEccErrors") == 1  # not supported: remembered


def test_a_query_that_raises_something_else_is_absent_from_that_sample_logged_once(caplog):
    nvml = FakeNvml()

    def broken(handle):
        raise RuntimeError("GPU is lost")

    nvml.nvmlDeviceGetPowerUsage = broken  # type: ignore[method-assign]
    clock = FakeClock()
    sampler = GpuHealthSampler(0, nvml=nvml, clock=clock)
    with caplog.at_level(logging.WARNING, logger="runwatch.producer.instrument.gpu_health"):
        for _ in range(3):
            figures = sampler.sample()
            assert figures is not None and "power_w" not in figures and "power_limit_w" in figures
            clock.now += 1.5
    assert len([r for r in caplog.records if "nvmlDeviceGetPowerUsage" in r.getMessage()]) == 1


def test_odd_answers_are_left_out_within_the_wires_bounds():
    nvml = FakeNvml({0: FakeDevice(temperature=10_000, util=250, power_mw=-5)})
    figures = GpuHealthSampler(0, nvml=nvml).sample()
    assert figures is not None
    assert "temperature_c" not in figures and "util_pct" not in figures and "power_w" not in figures


def test_a_uuid_device_is_looked_up_by_uuid_and_cuda_visible_devices_is_followed(monkeypatch):
    nvml = FakeNvml({0: FakeDevice(), 2: FakeDevice(sm_clock=1234)})
    figures = GpuHealthSampler("GPU-2", cuda_device=0, nvml=nvml).sample()
    assert figures is not None and figures["sm_clock_mhz"] == 1234 and figures["device"] == 0
    assert nvml.count("nvmlDeviceGetHandleByUUID") == 1
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (_ for _ in ()).throw(RuntimeError()))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert nvml_device_for(1) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert nvml_device_for(0) == "GPU-aaaa"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_device_for(1) == 1


class Collect:
    def __init__(self) -> None:
        self.beats: list[dict] = []

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None, host_load=None, gpu=None):
        self.beats.append({"step": step, "gpu": gpu})
        return True


class OldPublisher:  # an rw.heartbeat that takes no gpu
    def __init__(self) -> None:
        self.beats = 0

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None):
        self.beats += 1
        return True


def test_the_heartbeat_carries_gpu_and_a_publisher_without_it_gets_the_heartbeat_alone():
    clock = FakeClock()
    nvml = FakeNvml({0: FakeDevice(reasons=SW_THERMAL)})
    rw = Collect()
    hb = Heartbeat(rw, clock=clock, host_load=False, gpu_health=GpuHealthSampler(0, nvml=nvml, clock=clock))
    hb.set_step(4)
    assert hb.beat()
    assert rw.beats[0]["gpu"]["throttle_reasons"] == ["sw_thermal_slowdown"]
    HeartbeatEvent(run_id="r", step=4, gpu=rw.beats[0]["gpu"])  # what the publisher builds
    old = OldPublisher()
    assert Heartbeat(old, clock=clock, host_load=False, gpu_health=GpuHealthSampler(0, nvml=nvml)).beat()
    assert old.beats == 1
    assert Heartbeat(
        Collect(), clock=clock, gpu_health=GpuHealthSampler(0, nvml=FakeNvml(fail_init=True))
    ).beat()


def test_a_cpu_model_gets_no_sampler_by_default():
    model = nn.Linear(4, 1)
    watch = Watcher(
        Collect(), model, torch.optim.SGD(model.parameters(), lr=0.1), heartbeat_s=None, memory=False
    )
    watch.close()
    watch = Watcher(
        Collect(), model, torch.optim.SGD(model.parameters(), lr=0.1), heartbeat_s=60, memory=False
    )
    try:
        assert watch.heartbeat is not None and watch.heartbeat.gpu_health is None
    finally:
        watch.close()


class RecordingPublisher:
    def __init__(self) -> None:
        self.heartbeats: list[dict] = []

    def step(self, step: int, **fields) -> bool:
        return True

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None, host_load=None, gpu=None):
        self.heartbeats.append({"gpu": gpu, "thread": threading.get_ident()})
        return True


def test_the_training_thread_makes_no_nvml_call():
    """A real (tiny, CPU) training loop watched with a fake NVML: every NVML call, nvmlInit included, comes
    from the heartbeat thread, none from the training thread."""
    nvml = FakeNvml({0: FakeDevice(reasons=SW_THERMAL)})
    sampler = GpuHealthSampler(0, nvml=nvml, min_interval_s=0.05)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    rw = RecordingPublisher()
    training = threading.get_ident()
    watch = Watcher(rw, model, optimizer, heartbeat_s=0.02, memory=False, gpu_health=sampler)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    deadline = time.monotonic() + 5
    step = 0
    while (sampler.samples < 3 or step < 20) and time.monotonic() < deadline:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        watch.end_step(loss)
        step += 1
        time.sleep(0.005)
    watch.close()
    assert sampler.samples >= 3 and nvml.count("nvmlInit") == 1
    heartbeat_threads = {b["thread"] for b in rw.heartbeats if b["gpu"] is not None}
    assert len(heartbeat_threads) == 1 and training not in heartbeat_threads
    assert nvml.threads() == heartbeat_threads  # every NVML call, from the heartbeat thread only
    assert training not in nvml.threads()
    assert nvml.count("nvmlShutdown") == 1  # released as the heartbeat thread ended
