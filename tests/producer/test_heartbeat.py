"""Heartbeat: what the worker's stall detector sees (step, phase, time in phase), and a thread that
beats on its own, survives a failing publisher and stops cleanly."""

from __future__ import annotations

import threading

import pytest

from runwatch.producer.instrument import heartbeat as heartbeat_module
from runwatch.producer.instrument.heartbeat import PHASES, Heartbeat
from runwatch.producer.publish.run_watch import RunWatch


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingRunWatch:
    """Collects heartbeat calls; ``wait_for(n)`` blocks until n have arrived."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[int | None, str, float]] = []
        self.fail = fail
        self._changed = threading.Condition()

    def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None):
        with self._changed:
            self.calls.append((step, phase, time_in_phase_s))
            self._changed.notify_all()
        if self.fail:
            raise ConnectionError("publisher is broken")
        return True

    def wait_for(self, n: int, timeout: float = 5.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self.calls) >= n, timeout)


@pytest.fixture
def clock():
    return FakeClock()


def test_beat_publishes_last_step_phase_and_time_in_phase(clock):
    rw = RecordingRunWatch()
    hb = Heartbeat(rw, clock=clock)
    assert hb.current == (None, "train", 0.0)
    hb.set_step(41)
    clock.now += 7.5
    assert hb.beat() is True
    assert rw.calls == [(41, "train", 7.5)]


def test_enter_switches_phase_and_restarts_its_timer(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    clock.now += 10
    hb.enter("checkpoint")
    clock.now += 3
    assert hb.current == (None, "checkpoint", 3.0)
    hb.enter("checkpoint")
    assert hb.current[2] == 0.0


def test_nested_phases_restore_the_outer_phase_and_its_start_time(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    clock.now += 100  # 100 s of training
    with hb.phase("eval"):
        clock.now += 20
        with hb.phase("checkpoint"):
            clock.now += 5
            assert hb.current[1:] == ("checkpoint", 5.0)
        assert hb.current[1:] == ("eval", 25.0)
    assert hb.current[1:] == ("train", 125.0)


def test_phase_is_restored_when_the_block_raises(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    with pytest.raises(OSError), hb.phase("checkpoint"):
        raise OSError("disk full")
    assert hb.current[1] == "train"


def test_enter_inside_a_phase_block_is_undone_on_exit(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    with hb.phase("eval"):
        hb.enter("idle")
        assert hb.current[1] == "idle"
    assert hb.current[1] == "train"


def test_push_and_pop_bracket_a_data_wait_and_an_unmatched_pop_is_harmless(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    clock.now += 4
    hb.push("dataload")
    clock.now += 1
    assert hb.current[1:] == ("dataload", 1.0)
    hb.pop()
    hb.pop()
    assert hb.current[1:] == ("train", 5.0)


def test_unknown_phases_are_rejected(clock):
    hb = Heartbeat(RecordingRunWatch(), clock=clock)
    for bad in ("training", "", "TRAIN"):
        with pytest.raises(ValueError, match="unknown phase"):
            hb.enter(bad)
        with pytest.raises(ValueError), hb.phase(bad):
            pass
    with pytest.raises(ValueError):
        Heartbeat(RecordingRunWatch(), initial_phase="warmup")
    assert hb.current[1] == "train"
    assert set(PHASES) == {"train", "eval", "checkpoint", "dataload", "idle"}


def test_interval_must_be_positive():
    with pytest.raises(ValueError):
        Heartbeat(RecordingRunWatch(), interval_s=0)


def test_thread_beats_repeatedly_with_the_latest_state():
    rw = RecordingRunWatch()
    hb = Heartbeat(rw, interval_s=0.01)
    hb.set_step(3)
    hb.start()
    try:
        assert rw.wait_for(1)
        hb.set_step(4)
        hb.enter("eval")
        assert rw.wait_for(len(rw.calls) + 2)
    finally:
        hb.stop()
    assert rw.calls[0][:2] == (3, "train")
    assert rw.calls[-1][:2] == (4, "eval")


def test_stop_ends_the_thread_and_is_idempotent():
    rw = RecordingRunWatch()
    hb = Heartbeat(rw, interval_s=0.01)
    hb.stop()  # before start: nothing to do
    hb.start()
    hb.start()  # already running: no second thread
    assert sum(t.name == "runwatch-heartbeat" and t.is_alive() for t in threading.enumerate()) == 1
    assert rw.wait_for(2)
    hb.stop()
    hb.stop()
    assert not hb.running
    beats = len(rw.calls)
    assert not rw.wait_for(beats + 1, timeout=0.1)


def test_a_long_interval_does_not_delay_stop():
    hb = Heartbeat(RecordingRunWatch(), interval_s=3600)
    hb.start()
    thread = hb._thread
    hb.stop(timeout=5)
    assert not thread.is_alive()


def test_can_restart_after_stop_and_works_as_a_context_manager():
    rw = RecordingRunWatch()
    hb = Heartbeat(rw, interval_s=0.01)
    hb.start()
    hb.stop()
    with hb:
        assert hb.running
        assert rw.wait_for(len(rw.calls) + 1)
    assert not hb.running


def test_a_failing_publisher_does_not_stop_the_thread():
    rw = RecordingRunWatch(fail=True)
    hb = Heartbeat(rw, interval_s=0.01)
    assert hb.beat() is False
    hb.start()
    try:
        assert rw.wait_for(4)
        assert hb.running
    finally:
        hb.stop()


def test_stop_is_registered_at_exit_while_running(monkeypatch):
    registered = []
    monkeypatch.setattr(heartbeat_module.atexit, "register", registered.append)
    monkeypatch.setattr(heartbeat_module.atexit, "unregister", registered.remove)
    hb = Heartbeat(RecordingRunWatch(), interval_s=1)
    hb.start()
    assert registered == [hb.stop]
    hb.stop()
    assert registered == []


def test_heartbeats_reach_a_real_runwatch_as_valid_events(clock, monkeypatch, tmp_path):
    monkeypatch.setenv("RUNWATCH_SPOOL_DIR", str(tmp_path))  # what the broker does not take lands here
    rw = RunWatch("hb-run", "127.0.0.1:1", rank=1)  # nothing listens there
    try:
        hb = Heartbeat(rw, clock=clock)
        hb.set_step(12)
        with hb.phase("checkpoint"):
            clock.now += 30
            assert hb.beat() is True
        assert (rw.stats.queued, rw.stats.dropped) == (1, 0)  # an invalid event would be dropped as "invalid"
    finally:
        rw.close(timeout=0.1)


def test_an_eval_or_checkpoint_is_announced_at_once_not_at_the_next_interval():
    import threading

    class Collect:
        def __init__(self):
            self.beats = []
            self.got = threading.Event()

        def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None):
            self.beats.append(phase)
            self.got.set()
            return True

    rw = Collect()
    hb = Heartbeat(rw, interval_s=60.0)
    hb.start()
    try:
        assert rw.got.wait(2.0)  # the first beat, at start
        rw.got.clear()
        with hb.phase("dataload"):
            pass  # per-batch phases are not announced
        with hb.phase("eval"):
            assert rw.got.wait(2.0), "entering eval must beat at once"
            assert rw.beats[-1] == "eval"
            rw.got.clear()
        assert rw.got.wait(2.0), "leaving eval must beat at once"
        assert rw.beats == ["train", "eval", "train"]
    finally:
        hb.stop()


def test_the_first_beat_says_the_host_the_others_do_not(clock, monkeypatch):
    """Issue 39: a finding naming a rank is mapped to its machine by the host its first heartbeat said."""
    monkeypatch.setattr(heartbeat_module.socket, "gethostname", lambda: "node-17")
    sent: list[dict] = []

    class Publisher:
        def heartbeat(self, step, phase="train", time_in_phase_s=0.0, interval_s=None, host=None):
            sent.append({"step": step, "host": host})
            return True

    hb = Heartbeat(Publisher(), clock=clock)
    hb.beat()
    hb.beat()
    assert [s["host"] for s in sent] == ["node-17", None]
    # a publisher whose heartbeat takes no host gets none, and keeps beating
    rw = RecordingRunWatch()
    Heartbeat(rw, clock=clock).beat()
    assert len(rw.calls) == 1
