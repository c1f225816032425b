"""The hang evidence bundle (issue 38): the producer's capture rule on a fake clock (once per stall, after
``stacks_after_s``, only in train/dataload, nothing per step), what it captures (every thread's stack, the
training thread's innermost frame and its line, runwatch's threads marked, faulthandler as the fallback,
the flight recorder's dump or why not), the bounds and their marks (an over-sized event is truncated,
never refused), and the worker: the stacks kept with a rank's progress, attached to hung_rank and stall
findings, named in their message and the alert, never run or rendered as HTML."""

from __future__ import annotations

import pickle
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from io import BytesIO

import orjson
import pytest

from runwatch.contract.schema import (
    DEFAULT_LIMITS,
    HeartbeatEvent,
    RunStartEvent,
    SchemaError,
    StackEvidenceEvent,
    StackFrame,
    StepEvent,
    ThreadStack,
    WireLimits,
    bound_evidence,
    decode_event,
)
from runwatch.detectors import RunMonitor, RunwatchConfig
from runwatch.detectors.engine import evidence as worker_evidence
from runwatch.producer.instrument import stacks
from runwatch.producer.instrument.heartbeat import Heartbeat

# -- the capture rule -------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return self.now


class EvidenceRecorder:
    def __init__(self) -> None:
        self.sent: list[dict] = []

    def heartbeat(self, *args, **kwargs) -> bool:
        return True

    def evidence(self, step, **fields) -> bool:
        self.sent.append({"step": step, **fields})
        return True


def _heartbeat(clock: FakeClock, **options) -> tuple[Heartbeat, EvidenceRecorder]:
    rw = EvidenceRecorder()
    return Heartbeat(rw, interval_s=1.0, clock=clock, **options), rw


def test_stacks_go_once_per_stall_after_stacks_after_s_and_again_only_after_progress():
    clock = FakeClock()
    hb, rw = _heartbeat(clock, stacks_after_s=5.0)
    hb.check_stacks()  # no step yet: nothing
    hb.set_step(10)
    hb.check_stacks()  # (the heartbeat thread notes when it saw step 10)
    clock.now += 4.9
    assert hb.check_stacks() is False and rw.sent == []
    clock.now += 0.2
    assert hb.check_stacks() is True
    (sent,) = rw.sent
    assert sent["step"] == 10 and sent["reason"] == "no_progress" and sent["phase"] == "train"
    assert sent["seconds_since_step"] == pytest.approx(5.1)
    assert any(t.training for t in sent["threads"])  # (this test's thread built the heartbeat)
    clock.now += 60
    assert hb.check_stacks() is False and len(rw.sent) == 1  # the same stall: once
    hb.set_step(11)  # progress re-arms it
    hb.check_stacks()
    clock.now += 5.5
    assert hb.check_stacks() is True and [s["step"] for s in rw.sent] == [10, 11]


def test_no_stacks_in_a_long_eval_or_checkpoint_and_none_when_turned_off():
    clock = FakeClock()
    hb, rw = _heartbeat(clock, stacks_after_s=5.0)
    hb.set_step(3)
    hb.check_stacks()
    with hb.phase("eval"):
        clock.now += 100
        assert hb.check_stacks() is False
    # back in train: counted from the return, as the heartbeat thread sees it (the eval's time is no stall)
    assert hb.check_stacks() is False
    clock.now += 4
    assert hb.check_stacks() is False
    clock.now += 2
    assert hb.check_stacks() is True
    with hb.phase("dataload"):  # a data wait that does not end is a stall worth its stacks too
        hb.set_step(4)
        hb.check_stacks()
        clock.now += 6
        assert hb.check_stacks() is True
    off, rw_off = _heartbeat(FakeClock(), stacks_after_s=None)
    off.set_step(1)
    off._clock.now += 100  # type: ignore[attr-defined]
    assert off.check_stacks() is False and rw_off.sent == []
    with pytest.raises(ValueError):
        Heartbeat(EvidenceRecorder(), stacks_after_s=-1.0)


def test_the_per_step_path_gains_nothing():
    """set_step stays one attribute store: it reads no clock and calls nothing (the heartbeat thread
    notices the step move on its own)."""
    clock = FakeClock()
    hb, _ = _heartbeat(clock, stacks_after_s=5.0)
    before = clock.calls
    for n in range(1000):
        hb.set_step(n)
    assert clock.calls == before
    assert Heartbeat.set_step.__code__.co_names == ("_step",)


def test_the_heartbeat_thread_publishes_the_stacks_of_a_real_stall():
    rw = EvidenceRecorder()
    hb = Heartbeat(rw, interval_s=0.2, stacks_after_s=0.5)
    hb.set_step(7)
    hb.start()
    try:
        deadline = time.monotonic() + 5
        while not rw.sent and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        hb.stop()
    (sent,) = rw.sent
    (main,) = [t for t in sent["threads"] if t.training]
    assert main.frames[-1].function == "test_the_heartbeat_thread_publishes_the_stacks_of_a_real_stall"
    assert "time.sleep(0.02)" in (main.frames[-1].code or "")
    assert not any(t.name == "runwatch-heartbeat" for t in sent["threads"])  # (the capturing thread)
    assert hb.stacks_published == 1


# -- what is captured -------------------------------------------------------------------------------


def _parked(name: str, started: threading.Event, release: threading.Event) -> threading.Thread:
    def wait_here() -> None:
        started.set()
        release.wait(10)  # PARKED-LINE

    thread = threading.Thread(target=wait_here, name=name, daemon=True)
    thread.start()
    started.wait(5)
    return thread


def test_every_thread_is_captured_the_training_one_first_and_runwatch_s_marked():
    started, release = threading.Event(), threading.Event()
    user = _parked("user-loader", started, release)
    own_started = threading.Event()
    own = _parked("runwatch-publisher", own_started, release)
    try:
        threads, source = stacks.capture_threads(threading.get_ident(), max_frames=10)
    finally:
        release.set()
    assert source == "current_frames"
    assert threads[0].training and threads[0].name == threading.current_thread().name
    by_name = {t.name: t for t in threads}
    loader = by_name["user-loader"]
    assert not loader.training and not loader.runwatch
    functions = [f.function for f in loader.frames]
    assert functions[-1] == "wait" and "wait_here" in functions  # innermost last: in Event.wait's wait
    assert by_name["runwatch-publisher"].runwatch and threads[-1].runwatch
    user.join(5)
    own.join(5)


def test_deep_stacks_keep_their_innermost_frames_and_say_how_many_were_dropped():
    def down(n: int) -> tuple[list[ThreadStack], str]:
        if n == 0:
            return stacks.capture_threads(threading.get_ident(), max_frames=5)
        return down(n - 1)

    threads, _ = down(50)
    main = threads[0]
    assert len(main.frames) == 5 and main.frames_dropped > 45 and main.truncated
    assert [f.function for f in main.frames][-2:] == ["down", "capture_threads"] and main.frames[-1].code


def test_faulthandler_is_the_fallback(monkeypatch):
    def broken() -> dict:
        raise RuntimeError("no frames here")

    monkeypatch.setattr(sys, "_current_frames", broken)
    threads, source = stacks.capture_threads(threading.get_ident())
    assert source == "faulthandler"
    assert threads[0].training
    assert threads[0].frames[-1].function == "capture_threads" or any(
        f.function == "test_faulthandler_is_the_fallback" for f in threads[0].frames
    )


def test_faulthandler_text_is_parsed_innermost_last():
    text = (
        "Thread 0x00007f0000000001 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 327 in wait\n'
        '  File "/app/train.py", line 9 in main\n'
        "\n"
        "Current thread 0x00007f0000000002 (most recent call first):\n"
        '  File "/app/x.py", line 3 in <module>\n'
    )
    parsed = stacks.parse_faulthandler(text)
    assert [i for i, _ in parsed] == [0x7F0000000001, 0x7F0000000002]
    assert [f.function for f in parsed[0][1]] == ["main", "wait"]


def test_the_flight_recorder_is_attached_where_it_is_on_and_says_why_not_elsewhere(monkeypatch):
    assert stacks.flight_recorder_dump(environ={})[1].startswith("off:")
    monkeypatch.delitem(sys.modules, "torch._C._distributed_c10d", raising=False)
    text, status = stacks.flight_recorder_dump(environ={"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"})
    assert text is None and status.startswith("not available:")

    entries = [
        {"collective_seq_id": i, "profiling_name": "nccl:all_reduce", "retired": True} for i in range(500)
    ]

    class C10d:
        @staticmethod
        def _dump_fr_trace_json() -> bytes:
            return orjson.dumps({"version": "2.9", "entries": entries})

    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", C10d)
    text, status = stacks.flight_recorder_dump(2000, environ={"TORCH_FR_BUFFER_SIZE": "2000"})
    assert status.startswith("attached") and text is not None and len(text) <= 2000
    dumped = orjson.loads(text)
    assert dumped["entries"][-1]["collective_seq_id"] == 499  # the newest kept
    assert dumped["dropped_entries"] == 500 - len(dumped["entries"]) > 0

    class Failing:
        @staticmethod
        def _dump_nccl_trace_json() -> bytes:
            raise RuntimeError("no process group")

    monkeypatch.setitem(sys.modules, "torch._C._distributed_c10d", Failing)
    text, status = stacks.flight_recorder_dump(environ={"TORCH_FR_BUFFER_SIZE": "1"})
    assert text is None and status.startswith("not available: _dump_nccl_trace_json failed")


# -- bounds ----------------------------------------------------------------------------------------


def _huge_event() -> StackEvidenceEvent:
    main = ThreadStack(
        name="MainThread",
        training=True,
        frames=[StackFrame(file="/deep/" * 100 + "train.py", line=i, function="f") for i in range(300)],
    )
    others = [
        ThreadStack(name=f"worker-{i}", frames=[StackFrame(file="w.py", line=1, function="g" * 100)] * 60)
        for i in range(60)
    ]
    return StackEvidenceEvent(
        run_id="r",
        step=5,
        threads=[*others[:30], main, *others[30:]],
        flight_recorder="x" * 100_000,
        flight_recorder_status="attached",
    )


def test_an_over_sized_evidence_event_is_truncated_with_marks_never_refused():
    event = _huge_event()
    raw = event.to_json()
    assert DEFAULT_LIMITS.max_evidence_bytes * 10 < len(raw) < DEFAULT_LIMITS.max_message_bytes
    decoded = decode_event(raw)  # accepted: over its bounds, under the message limit
    assert isinstance(decoded, StackEvidenceEvent)
    assert decoded.truncated and len(decoded.to_json()) <= DEFAULT_LIMITS.max_evidence_bytes
    assert decoded.threads_dropped > 0 and len(decoded.threads) <= DEFAULT_LIMITS.max_evidence_threads
    (main,) = [t for t in decoded.threads if t.training]  # the training thread is never cut
    assert main.truncated and main.frames_dropped > 0 and main.frames[-1].line == 299  # innermost kept
    assert main.frames[-1].file.startswith("\u2026") and main.frames[-1].file.endswith("train.py")
    assert decoded.flight_recorder is None or "flight recorder truncated" in decoded.flight_recorder
    assert bound_evidence(decoded) is decoded  # the producer's cut is the worker's: nothing more to cut
    # what is within the bounds passes as it is
    plain = StackEvidenceEvent(
        run_id="r", step=1, threads=[main.model_copy(update={"frames": main.frames[-3:]})]
    )
    assert bound_evidence(plain) is plain


def test_the_configured_bounds_cut_threads_and_frames_and_the_flight_recorder_text():
    lim = WireLimits(max_evidence_threads=2, max_evidence_frames=3, max_evidence_bytes=8192)
    threads = [
        ThreadStack(name=f"t{i}", frames=[StackFrame(file="a.py", line=j, function="f") for j in range(10)])
        for i in range(5)
    ]
    threads[3] = threads[3].model_copy(update={"training": True})
    event = StackEvidenceEvent(run_id="r", threads=threads, flight_recorder="y" * 10_000)
    cut = bound_evidence(event, lim)
    assert [t.name for t in cut.threads] == ["t0", "t3"] and cut.threads_dropped == 3
    assert all(len(t.frames) == 3 and t.frames_dropped == 7 for t in cut.threads)
    assert cut.flight_recorder is not None and len(cut.flight_recorder) <= 4096
    assert cut.flight_recorder.endswith("of 10000 characters kept]")


def test_a_malformed_evidence_event_is_still_refused():
    head = b'{"schema_version":1,"event_id":"e","run_id":"r","rank":0,"ts":"2026-01-01T00:00:00Z",'
    with pytest.raises(SchemaError, match="threads"):
        decode_event(
            head + b'"kind":"evidence","threads":[{"frames":[{"file":"a","line":"7","function":"f"}]}]}'
        )
    with pytest.raises(SchemaError, match="seconds_since_step"):
        decode_event(head + b'"kind":"evidence","seconds_since_step":1e300}')


# -- the worker ------------------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)
RUN = "hang-ev"
SITE = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def stack_event(rank: int, step: int, t: float, culprit: bool, code: str = "time.sleep(600)"):
    inner = (
        StackFrame(file="/app/dist_train.py", line=151, function="train_step", code=code)
        if culprit
        else StackFrame(file=SITE, line=3252, function="all_reduce", code="work.wait()")
    )
    frames = [StackFrame(file="/app/dist_train.py", line=200, function="main"), inner]
    return StackEvidenceEvent(
        run_id=RUN,
        rank=rank,
        step=step,
        ts=at(t),
        seconds_since_step=5.0,
        threads=[
            ThreadStack(name="MainThread", thread_id=1, training=True, frames=frames),
            ThreadStack(name="runwatch-publisher", thread_id=2, runwatch=True, frames=frames[:1]),
        ],
        flight_recorder=orjson.dumps(
            {
                "entries": [
                    {"profiling_name": "gloo:all_reduce", "collective_seq_id": 50, "state": "scheduled"}
                ]
            }
        ).decode(),
        flight_recorder_status="attached (_dump_fr_trace_json: gloo and NCCL)",
    )


def hung_run(world: int = 4, culprit: int = 2, code: str = "time.sleep(600)"):
    """A monitor of ``world`` ranks in lockstep for 20 steps (0.5 s each), then stopped at step 19 with every
    rank beating (none says in_sync: an explicit collective, no DDP hook) and sending its stacks at 25 s;
    returns the monitor and every output until 60 s."""
    monitor = RunMonitor(RUN, RunwatchConfig())
    outs = [monitor.observe(RunStartEvent(run_id=RUN, ts=T0, world_size=world))]
    for n in range(20):
        for rank in range(world):
            outs.append(monitor.observe(StepEvent(run_id=RUN, rank=rank, step=n, ts=at(n * 0.5), loss=1.0)))
    t = 9.5
    while t < 60:
        t += 1.0
        for rank in range(world):
            outs.append(
                monitor.observe(HeartbeatEvent(run_id=RUN, rank=rank, step=19, ts=at(t), interval_s=1.0))
            )
            if t == 14.5:
                outs.append(monitor.observe(stack_event(rank, 19, t, rank == culprit, code)))
        outs.append(monitor.tick(at(t)))
    return monitor, outs


def test_hung_rank_names_the_culprit_from_the_stacks_with_every_rank_s_stack_and_frame():
    monitor, outs = hung_run()
    anomalies = [a for o in outs for a in o.anomalies]
    (hung,) = [a for a in anomalies if a.detector == "hung_rank"]
    assert hung.rank == 2 and hung.evidence["kind"] == "peers_waiting"
    stacks_ = hung.evidence["stacks"]
    assert set(stacks_) == {"0", "1", "2", "3"} and hung.evidence["stacks_missing"] == 0
    assert stacks_["2"]["waits_in"] == "dist_train.py:151 in train_step"
    assert stacks_["2"]["frames"][-1] == "/app/dist_train.py:151 in train_step"
    assert stacks_["0"]["collective"] == "all_reduce"
    assert stacks_["0"]["flight_recorder"].startswith("in flight: gloo:all_reduce #50 (scheduled)")
    assert hung.evidence["waits_in"]["1"] == "torch/distributed/distributed_c10d.py:3252 in all_reduce"
    assert (
        "rank 2 waits in dist_train.py:151 in train_step (`time.sleep(600)`); ranks 0, 1, 3 wait in "
        "all_reduce (torch/distributed/distributed_c10d.py:3252)" in hung.message
    )
    assert "wait for it in a collective" in hung.message
    # the alert the policy issues for it says the same, and carries each rank's frame
    (alert,) = [d for o in outs for d in o.decisions if hung.anomaly_id in d.anomaly_ids]
    assert "dist_train.py:151 in train_step" in alert.reason
    assert alert.params["waits_in"]["2"] == "dist_train.py:151 in train_step"
    # stall findings carry them too
    stalls = [a for a in anomalies if a.detector == "stall" and a.evidence["kind"] == "stalled"]
    assert stalls and all("stacks" in a.evidence for a in stalls)
    assert all(f"rank {a.rank} waits in" in a.message for a in stalls)


def test_without_stacks_nobody_is_pinned_and_progress_clears_them():
    monitor = RunMonitor(RUN, RunwatchConfig())
    monitor.observe(RunStartEvent(run_id=RUN, ts=T0, world_size=2))
    for n in range(20):
        for rank in range(2):
            monitor.observe(StepEvent(run_id=RUN, rank=rank, step=n, ts=at(n * 0.5), loss=1.0))
    monitor.observe(stack_event(0, 19, 10.0, culprit=False))
    assert monitor.progress.ranks[0].stack is not None
    monitor.observe(stack_event(1, 3, 10.0, culprit=True))  # about a step long past: stale, dropped
    assert monitor.progress.ranks[1].stack is None
    monitor.observe(StepEvent(run_id=RUN, rank=0, step=20, ts=at(10.5), loss=1.0))
    assert monitor.progress.ranks[0].stack is None


def test_a_stack_line_that_reads_as_markup_is_text_in_the_finding_and_the_report():
    from runwatch.sinks.report.html import stacks_section
    from tests.sinks.test_report_panels import data

    script = "<script>alert('x')</script>"
    _, outs = hung_run(code=script)
    (hung,) = [a for o in outs for a in o.anomalies if a.detector == "hung_rank"]
    assert script in hung.message  # (text, as the rank sent it)
    row = {**hung.model_dump(), "evidence": orjson.loads(orjson.dumps(hung.evidence))}
    html = stacks_section(data(anomalies=[row]))
    assert "<script>" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert "dist_train.py:151 in train_step" in html and "all_reduce" in html


def test_the_stacks_in_a_run_s_state_pickle_and_load_through_the_state_unpickler():
    from runwatch.worker.state.classes import StateUnpickler

    monitor, _ = hung_run()
    data = pickle.dumps(monitor)
    loaded = StateUnpickler(BytesIO(data)).load()
    assert loaded.progress.ranks[2].stack["waits_in"] == "dist_train.py:151 in train_step"


def test_the_group_and_merge_monitors_take_an_evidence_event_without_a_report_item():
    from runwatch.detectors.engine.group_monitor import GroupMonitor

    group = GroupMonitor(RUN, RunwatchConfig(), group=0, group_size=2, world_size=4)
    out = group.observe(
        stack_event(1, 19, 1.0, culprit=True).model_copy(update={"group_size": 2, "world_size": 4})
    )
    assert out.report == [] and group.progress.ranks[1].stack is not None


def test_a_kind_the_monitor_does_not_know_is_ignored():
    monitor = RunMonitor(RUN, RunwatchConfig())
    future = HeartbeatEvent.model_construct(run_id=RUN, rank=0, ts=T0, event_id="f", kind="future_kind")
    assert monitor.observe(future).anomalies == []


def test_the_sink_stores_a_truncated_evidence_event_as_cut():
    from runwatch.sinks.rows import event_row

    raw = _huge_event().to_json()
    decoded = decode_event(raw)
    row = event_row(decoded, raw)
    assert row[3] == "evidence" and len(row[-1]) <= DEFAULT_LIMITS.max_evidence_bytes
    small = stack_event(0, 1, 0.0, culprit=True)
    assert event_row(small, small.to_json())[-1] == small.to_json().decode()


def test_the_summary_is_bounded():
    event = stack_event(0, 1, 0.0, culprit=True)
    long = ThreadStack(
        name="MainThread",
        training=True,
        frames=[StackFrame(file="/x/" * 100 + "a.py", line=i, function="f" * 200) for i in range(60)],
    )
    summary = worker_evidence.summarize(event.model_copy(update={"threads": [long]}))
    assert len(summary["frames"]) == worker_evidence.KEPT_FRAMES
    assert summary["frames_dropped"] == 60 - worker_evidence.KEPT_FRAMES
    assert all(len(f) <= worker_evidence.FRAME_CHARS for f in summary["frames"])
    assert len(orjson.dumps(summary)) < 10_000
