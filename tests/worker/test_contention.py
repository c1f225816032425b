"""Contention evidence (issue 12): a real CPU-bound torch training run, its heartbeats carrying the
host's load, a real broker and a real worker. CPU hogs started beside the run mid-way slow it down:
the throughput finding says the host got busier at the same step. The same slowdown made by the
loop itself (a sleep per step, no hog) gives a finding that says the host did not.

The machine may be shared (2 cores, other tests): the evidence that settles it is this process's
run-queue wait (seconds its threads were runnable but had no CPU, per second), which hogs on the
same cores raise at once while a sleeping loop lowers it; the 1-minute load average lags a short
test and is reported, not relied on."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest
import torch

from runwatch.contract import topics
from runwatch.contract.schema import Anomaly, decode_anomaly
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.producer import RunWatch
from runwatch.scenarios.threads import one_torch_thread
from tests.conftest import cpu_bound_mlp, read_topic, worker_with_config

pytestmark = pytest.mark.integration

HOGS = 3  # busy processes on a 2-core machine: the training thread gets well under half a core
CALM_S = 6.0  # seconds of training before the slowdown (a baseline of heartbeats at HEARTBEAT_S)
SLOW_S = 7.0  # and after it
# The slowdown starts once the last STEADY_STEPS steps (the detector's window) hold one level, so
# that it is measured against that level: a loaded CI run saw the machine slow the calm steps by 69%
# (found, and the detector restarted at that level) just before the hogs, whose slowdown against it
# then fell short of min_change. Waited for at most STEADY_WAIT_S past CALM_S.
STEADY_STEPS = 100
STEADY_SPREAD = 1.3  # the slowest 20-step median at most this times the fastest
STEADY_WAIT_S = 20.0
HEARTBEAT_S = 0.25

CONFIG = {
    "detectors": {
        # test-sized: a finding may come 20 steps into the run (the default waits 30); the slowdowns here
        # are 2-4x, so a blip of the shared machine (+30%) is not one, and one before the slowdown mutes
        # the detector for 30 steps, not 100
        "throughput_drift": {"warmup": 20, "min_change": 0.6, "cooldown_steps": 30},
    },
    "policy": {"rules": [{"detector": "*", "min_severity": "warning", "action": "alert"}]},
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A broker of this module's own: the tests take the first throughput finding of their run, and on
    the session's broker the default-config worker may publish its own beside this module's worker's."""
    with EmbeddedBroker(log_path=tmp_path_factory.mktemp("contention-broker") / "broker.log") as b:
        ensure_topics(b.bootstrap)
        yield b


@pytest.fixture(scope="module")
def contention_worker(broker, action_keys, tmp_path_factory):
    """The only worker of this module's broker, with the test-sized throughput config."""
    with worker_with_config(
        broker,
        action_keys,
        tmp_path_factory.mktemp("contention-worker"),
        CONFIG,
        "runwatch-detect-contention",
    ) as worker:
        yield worker


def steady(step_times: list[float]) -> bool:
    """Whether the last STEADY_STEPS step times hold one level (20-step medians within STEADY_SPREAD)."""
    if len(step_times) < STEADY_STEPS:
        return False
    recent = step_times[-STEADY_STEPS:]
    medians = [statistics.median(recent[i : i + 20]) for i in range(0, STEADY_STEPS, 20)]
    return max(medians) <= STEADY_SPREAD * min(medians)


def train(bootstrap: str, run_id: str, slow_down: Callable[[float], Callable[[], None]]) -> int:
    """A CPU-bound MLP trained for CALM_S and until its step time is steady, then ``slow_down(the calm
    steps' median time)`` (returns the per-step extra, called each step) and SLOW_S more. Returns the
    first step after the slowdown began."""
    with one_torch_thread():  # one training thread, as a loaded data-parallel worker would have
        model, optimizer, x, y = cpu_bound_mlp()
        rw = RunWatch(run_id, bootstrap)
        watch = rw.watch(model, optimizer, heartbeat_s=HEARTBEAT_S, update_every=50)
        step, per_step, onset, slowed_at = 0, (lambda: None), None, 0.0
        calm: list[float] = []
        started = last = time.monotonic()
        try:
            while onset is None or last - slowed_at < SLOW_S:
                if (
                    onset is None
                    and last - started >= CALM_S
                    and (steady(calm) or last - started >= CALM_S + STEADY_WAIT_S)
                ):
                    per_step, onset, slowed_at = slow_down(statistics.median(calm)), step, last
                loss = torch.nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                per_step()
                watch.end_step(loss, step=step, samples=len(x))
                step += 1
                now = time.monotonic()
                if onset is None:
                    calm = [*calm[-(STEADY_STEPS - 1) :], now - last]
                last = now
        finally:
            watch.close()
            rw.close()
        return onset


def throughput_findings(bootstrap: str, run_id: str, onset: int, timeout: float = 30.0) -> list[Anomaly]:
    """The run's throughput findings made after the slowdown began, with an onset near it (a shared
    machine may add others before it). Near: within the detector's 100-step window, since a machine
    that wavered just before the slowdown (steps +30-60%) can move the change point that far back:
    a CI run saw the sleep start at step 429 and a finding "since about step 350" over the 130 steps
    that include it."""
    key = run_id.encode()

    def ours(records) -> list[Anomaly]:
        found = [decode_anomaly(r.value) for r in records if r.key == key]
        return [
            a
            for a in found
            if a.detector == "throughput_drift"
            and a.step >= onset
            and a.evidence.get("onset_step", -(10**9)) >= onset - 100
        ]

    try:
        return ours(read_topic(bootstrap, topics.ANOMALIES, lambda rs: bool(ours(rs)), timeout=timeout))
    except AssertionError:
        every = read_topic(bootstrap, topics.ANOMALIES, lambda rs: True, timeout=5)
        found = [decode_anomaly(r.value) for r in every if r.key == key]
        raise AssertionError(
            f"no throughput finding near step {onset}; the run's: "
            f"{[(a.detector, a.step, a.message) for a in found]}"
        ) from None


def test_cpu_hogs_beside_the_run_are_named_in_the_throughput_finding(broker, contention_worker):
    run_id = f"contention-hog-{uuid.uuid4().hex[:8]}"
    hogs: list[subprocess.Popen] = []

    def start_hogs(_calm_step_s: float):
        hogs.extend(subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(HOGS))
        return lambda: None

    try:
        onset = train(broker.bootstrap, run_id, start_hogs)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(10)
    finding = throughput_findings(broker.bootstrap, run_id, onset)[0]
    host = finding.evidence["host_load"]
    print(f"\nhog run: {finding.message}\nbefore={host['before']}\nnow={host['now']}")
    assert finding.evidence["after_s"] > 1.3 * finding.evidence["before_s"]
    assert host["busier"] is True, host
    assert "cpu_wait" in host["reasons"]
    assert host["now"]["cpu_wait_frac"] >= host["before"]["cpu_wait_frac"] + 0.25
    assert host["before"]["last_step"] < host["now"]["first_step"]
    assert "host busier at the same step" in finding.message
    assert host["before"]["cpus"] >= 1 and "load1" in host["before"] and "load1" in host["now"]


def test_a_slowdown_of_the_run_own_making_carries_no_contention(broker, contention_worker):
    run_id = f"contention-sleep-{uuid.uuid4().hex[:8]}"

    def sleep_each_step(calm_step_s: float):
        pause = 2 * calm_step_s  # the run gets about 3x slower, no other process involved
        return lambda: time.sleep(pause)

    onset = train(broker.bootstrap, run_id, sleep_each_step)
    finding = throughput_findings(broker.bootstrap, run_id, onset)[0]
    host = finding.evidence["host_load"]
    print(f"\nsleep run: {finding.message}\nbefore={host['before']}\nnow={host['now']}")
    assert finding.evidence["after_s"] > 1.3 * finding.evidence["before_s"]
    assert host["busier"] is False, host  # attributed to the run itself, and still reported
    assert "host busier" not in finding.message and "host load unchanged" in finding.message
