"""A state record cannot run code in the worker (issue 35): the snapshot body is read by an unpickler that
resolves only what a run's state is made of (worker/runwatch/worker/state/classes.py), and the
record is signed with the workers' own state key, never the action secret every trainer holds.

- every name that real snapshots reference is admitted: each registered detector's state, cut at several
  places of the conformance suite's faulty streams, and whole runs' state records as the worker's
  processor writes them (one rank, three ranks with a straggler and a hang, a rollback and its replay, a
  baseline band and history handed over at run_start), so a detector that starts holding something new
  fails here, not in a restore;
- a pickle that calls ``os.system`` is refused, whichever key signs it, and its command never runs; names
  outside the allowlist (``eval``, ``getattr``, ``subprocess.Popen``, a function or an imported name of an
  admitted module, a dotted path through one) are refused before their module is even imported;
- a refused record is counted, logged with its topic, partition and offset, and its run starts fresh
  (its NaN is still found);
- the state key: required with durable state, 32 bytes or more, never the action secret.

Run as a script, it lists every name real snapshots reference and whether it is admitted:
``.venv/bin/python -m tests.worker.test_state_classes``.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import sys
import zlib
from collections.abc import Iterator
from datetime import timedelta
from functools import cache
from pathlib import Path

import pytest

from runwatch.contract.schema import StepEvent
from runwatch.detectors import registry
from runwatch.detectors.config import RunwatchConfig
from runwatch.worker.processor import StateRecord, TelemetryProcessor
from runwatch.worker.state.classes import (
    RefusedName,
    StateUnpickler,
    is_admitted,
    own_modules,
    referenced_globals,
)
from runwatch.worker.state.run_states import StateOptions
from runwatch.worker.state.snapshot import (
    STATE_SECRET_ENV,
    MissingStateSecretError,
    SnapshotError,
    SnapshotHeader,
    config_digest,
    decode_body,
    decode_header,
    encode_snapshot,
    resolve_state_secret,
)
from tests.detectors.test_conformance import EVENTS, MULTI_RANK, REPLAYED, SPECS, Feed, build, events_for
from tests.support.action_keys import PUBLIC, SEED

# What a trainer holds: the actions' public key (and, in an old deployment, the shared action secret)
TRAINER_KEY = PUBLIC.text.encode()
OLD_ACTION_SECRET = b"the-old-action-secret-every-trainer-held-0123"
STATE_KEY = b"the-workers-own-state-key-32-bytes-or-more-456"
CONFIG = RunwatchConfig.model_validate({"policy": {"confirm_steps": 12}})


# -- real snapshots ----------------------------------------------------------------------------------


def detector_snapshots(spec: registry.DetectorSpec) -> Iterator[bytes]:
    """``spec``'s detector pickled at a quarter, half, three quarters and the end of its conformance
    stream (healthy, then every fault its view looks for: open episodes, cooldowns, watches)."""
    events = events_for(spec)
    feed, detector = Feed(spec), build(spec)
    done = 0
    for cut in (len(events) // 4, len(events) // 2, len(events) * 3 // 4, len(events)):
        feed.run(detector, events[done:cut])
        done = cut
        yield pickle.dumps(detector, protocol=pickle.HIGHEST_PROTOCOL)


class _Store:
    """The compacted topic as a successor reads it: the newest record per key (``StateReader.read``)."""

    topic = "runwatch.state"

    def __init__(self) -> None:
        self.values: dict[str, bytes | None] = {}
        self.origin: dict[str, tuple[int, int]] = {}
        self.offset = 0

    def write(self, records: list[StateRecord]) -> None:
        for r in records:
            self.values[r.key], self.origin[r.key] = r.value, (r.partition, self.offset)
            self.offset += 1

    def read(self, partitions: set[int]) -> dict[str, bytes | None]:
        return dict(self.values)

    def scan(self, topic: str, partitions: object, tail: int | None, timeout_s: float | None = None):
        return iter(())


def _processor(store: _Store, wall=None) -> TelemetryProcessor:
    last = max(e.ts for e in EVENTS + MULTI_RANK + REPLAYED)
    return TelemetryProcessor(
        CONFIG,
        SEED,
        clock=lambda: wall or last + timedelta(hours=1),
        state_reader=store,  # type: ignore[arg-type]
        state=StateOptions(every_events=50, interval_s=1e9),
        state_secret=STATE_KEY,
    )


def _bodies(records: list[StateRecord]) -> list[bytes]:
    out = []
    for r in records:
        if r.value is not None:
            _, body = decode_header(r.value, STATE_KEY)
            if len(body):
                out.append(zlib.decompress(body))
    return out


@cache
def run_snapshots(name: str) -> list[bytes]:
    """The pickled bodies of the state records the worker's processor writes for a run (every 50 events
    and at checkpoints), fed as JSON bytes as the worker reads them."""
    if name == "band":
        return _band_snapshots()
    events = {
        "one_rank": EVENTS,
        "three_ranks": MULTI_RANK,
        "rollback_replayed": REPLAYED,
        "crashed": _crashed(),
    }[name]
    store = _Store()
    proc = _processor(store)
    proc.keep_partitions({0})
    bodies = []
    for offset, event in enumerate(events):
        proc.process(event.to_json(), key=event.run_id.encode(), partition=0, offset=offset)
        if offset % 40 == 39:
            proc.tick(event.ts)
        records, _ = proc.take_snapshots(force_checkpoint=offset % 97 == 96)
        bodies += _bodies(records)
    bodies += _bodies(proc.take_snapshots(force_checkpoint=True)[0])
    return bodies


def _band_snapshots() -> list[bytes]:
    """A run given a baseline band and a history at its start (what the worker's BaselineLoader gives)."""
    from runwatch.contract.schema import RunStartEvent
    from runwatch.detectors.baseline_trajectory import hand_band
    from runwatch.detectors.baselines.summary import RunSummarizer
    from tests.detectors.test_baseline_trajectory import BAND, run  # a band of five seeded runs of one job

    events = run(9, run_id="live")
    store = _Store()
    proc = _processor(store, events[-1].ts + timedelta(hours=1))
    proc.keep_partitions({0})
    proc.process(RunStartEvent(run_id="live", ts=events[0].ts).to_json(), key=b"live", partition=0, offset=0)
    monitor = proc.monitors["live"]
    monitor.set_history([RunSummarizer(f"old-{i}").summary() for i in range(3)], None)
    hand_band(monitor.joined_detectors, BAND, None)
    bodies = []
    for offset, event in enumerate(events, start=1):
        proc.process(event.to_json(), key=b"live", partition=0, offset=offset)
        bodies += _bodies(proc.take_snapshots(force_checkpoint=offset % 60 == 0)[0])
    return bodies + _bodies(proc.take_snapshots(force_checkpoint=True)[0])


def _crashed() -> list:
    """A run whose data thread dies (the monitor holds the crash watch while the run goes on), then whose
    launcher reports a SIGSEGV (the cause: a restart, and the ended run's marker carries the history)."""
    from runwatch.contract.schema import CrashEvent

    events = list(EVENTS[:120])
    ts = events[-1].ts
    thread = CrashEvent(
        run_id="conf", ts=ts, source="thread_exception", exception_type="ValueError", message="bad row"
    )
    segv = CrashEvent(run_id="conf", ts=ts + timedelta(seconds=1), source="launcher", signal=11, host="n1")
    return events[:60] + [thread] + events[60:] + [segv]


RUNS = ["one_rank", "three_ranks", "rollback_replayed", "band", "crashed"]


def all_real_snapshots() -> Iterator[tuple[str, bytes]]:
    for spec in SPECS:
        for data in detector_snapshots(spec):
            yield spec.name, data
    for name in RUNS:
        for data in run_snapshots(name):
            yield name, data


# -- every name real snapshots reference is admitted -------------------------------------------------


def _refused(snapshots) -> set[tuple[str, str]]:
    return {ref for data in snapshots for ref in referenced_globals(data) if not is_admitted(*ref)}


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_every_name_a_registered_detector_s_state_references_is_admitted(spec):
    snapshots = list(detector_snapshots(spec))
    assert not _refused(snapshots), (
        f"{spec.name}'s state references names the state unpickler refuses: admit them in "
        "worker/runwatch/worker/state/classes.py if they are safe to load"
    )
    assert spec.config.__module__ in own_modules()
    for data in snapshots:  # and it loads through the state unpickler as through pickle
        assert pickle.dumps(StateUnpickler(io.BytesIO(data)).load()) == pickle.dumps(pickle.loads(data))


@pytest.mark.parametrize("name", RUNS)
def test_every_name_a_run_s_state_records_reference_is_admitted(name):
    snapshots = run_snapshots(name)
    assert len(snapshots) >= 3
    assert not _refused(snapshots), "admit them in state_classes.py if they are safe to load"
    for data in snapshots:
        assert pickle.dumps(StateUnpickler(io.BytesIO(data)).load()) == pickle.dumps(pickle.loads(data))


def test_the_lister_finds_exactly_what_unpickling_resolves():
    """``referenced_globals`` reads pickles without running them: it must name what ``find_class`` is
    asked for, or the tests above would check less than they say."""
    asked: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            asked.add((module, name))
            return super().find_class(module, name)

    listed: set[tuple[str, str]] = set()
    for name in ("three_ranks", "band"):
        for data in run_snapshots(name):
            Recording(io.BytesIO(data)).load()
            listed |= referenced_globals(data)
    assert listed == asked
    assert ("runwatch.worker.processor", "RunState") in listed
    assert any(module.startswith("river") for module, _ in listed)
    assert any(module.startswith("numpy") for module, _ in listed)


# -- what is refused --------------------------------------------------------------------------------


class RunsCode:
    """What a hostile trainer would write: a pickle that calls ``os.system`` when it is loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _header(run_id: str = "r", partition: int = 0) -> SnapshotHeader:
    from runwatch.contract.schema import utc_now

    return SnapshotHeader(
        run_id=run_id,
        partition=partition,
        offset=-1,
        events=1,
        taken_at=utc_now(),
        config_sha=config_digest(CONFIG.model_dump_json()),
    )


def test_the_code_running_pickle_really_runs_code_when_plainly_unpickled(tmp_path):
    """(So that the tests below, where it does not, mean something.)"""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(RunsCode(marker)))
    assert marker.exists()


@pytest.mark.parametrize(
    "key",
    [TRAINER_KEY, OLD_ACTION_SECRET, b"", STATE_KEY],
    ids=["public_key", "old_action_secret", "no_key", "the_workers_state_key"],
)
def test_a_pickle_that_calls_os_system_is_refused_whichever_key_signs_it(tmp_path, key):
    marker = tmp_path / "MARKER"
    raw = encode_snapshot(_header(), RunsCode(marker), key)
    with pytest.raises(SnapshotError) as refused:
        decode_body(decode_header(raw, STATE_KEY)[1])
    if key == STATE_KEY:  # signed right (a leaked key): the unpickler refuses it
        assert "system, which a run's state is not made of" in str(refused.value)
    else:  # a trainer's keys: refused before the body is looked at
        assert "not signed with the workers' state key" in str(refused.value)
    # and the body on its own, whatever the signature said
    body = memoryview(raw)[4 + 32 + 4 + len(_header().model_dump_json().encode()) :]
    with pytest.raises(SnapshotError, match="system"):
        decode_body(body)
    assert not marker.exists()


def _global(module: str, name: str) -> list[bytes]:
    """Pickles that name ``module.name`` and call it: protocol 0 (GLOBAL) and protocol 4 (STACK_GLOBAL)."""
    m, n = module.encode(), name.encode()
    call = b"(S'true'\ntR."
    return [
        b"c" + m + b"\n" + n + b"\n" + call,
        b"\x80\x04\x8c" + bytes([len(m)]) + m + b"\x8c" + bytes([len(n)]) + n + b"\x93" + call,
    ]


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("builtins", "open"),
        ("importlib", "import_module"),
        ("copyreg", "_reconstructor"),
        ("numpy", "load"),
        ("collections", "namedtuple"),
        ("runwatch.detectors.engine.monitor", "OrderedDict"),  # a name the module imported
        ("runwatch.detectors.engine.monitor", "RunMonitor.__init__"),  # a dotted path through a class
        ("runwatch.detectors.baselines.band", "band_from_runs"),  # a function, not a class
        ("runwatch.worker.processor", "TelemetryProcessor"),  # only RunState of that module
        ("runwatch.detectors.offline.replay", "replay"),  # a module a run's state is not made of
        ("this", "s"),  # importing it prints: refused before the import
    ],
)
def test_names_outside_a_run_s_state_are_refused_before_anything_is_imported(module, name):
    was_imported = module in sys.modules
    for data in _global(module, name):
        with pytest.raises(RefusedName, match="not made of"):
            StateUnpickler(io.BytesIO(data)).load()
    assert not is_admitted(module, name)
    assert (module in sys.modules) == was_imported


def test_a_refused_record_is_counted_logged_where_it_is_and_its_run_starts_fresh(tmp_path, caplog):
    """Two records that would run code (one signed with a trainer's key, one with the workers' key) and a
    genuine one: the genuine run is restored; the other two are counted, logged with their topic,
    partition and offset, and start fresh, their NaN found by their new detectors."""
    marker = tmp_path / "MARKER"
    store = _Store()
    first = _processor(store)
    first.keep_partitions({0})
    steps = [StepEvent(run_id="good", step=s, loss=1.0, ts=EVENTS[s].ts).to_json() for s in range(30)]
    for offset, raw in enumerate(steps):
        first.process(raw, key=b"good", partition=0, offset=offset)
    store.write(first.take_snapshots(force_checkpoint=True)[0])
    for run_id, key in (("by-trainer", TRAINER_KEY), ("leaked-key", STATE_KEY)):
        value = encode_snapshot(_header(run_id), RunsCode(marker), key)
        store.write([StateRecord(f"runwatch-detect/{run_id}", 0, value)])

    second = _processor(store)
    with caplog.at_level(logging.ERROR, logger="runwatch.worker"):
        second.keep_partitions({0})
    assert set(second.monitors) == {"good"}
    assert second.counters.restore_failures == 2 and second.counters.restored_runs == 1
    said = [r.getMessage() for r in caplog.records]
    assert any(
        "run by-trainer: its state record runwatch.state[0]@1 cannot be read" in s and "not signed" in s
        for s in said
    ), said
    assert any(
        "run leaked-key: its state record runwatch.state[0]@2 cannot be read" in s and "posix.system" in s
        for s in said
    ), said
    for run_id in ("by-trainer", "leaked-key"):
        found = []
        for step in range(30):
            loss = math.nan if step >= 25 else 1.0
            raw = StepEvent(run_id=run_id, step=step, loss=loss, ts=EVENTS[step].ts).to_json()
            found += second.process(raw, key=run_id.encode(), partition=0, offset=100 + step).anomalies
        assert second.monitors[run_id].events_seen == 30  # fresh: nothing restored
        assert "non_finite" in {a.detector for a in found}
    assert not marker.exists()


# -- the state key ----------------------------------------------------------------------------------


def test_the_state_key_is_required_long_enough_and_never_an_action_key(monkeypatch):
    monkeypatch.delenv(STATE_SECRET_ENV, raising=False)
    with pytest.raises(MissingStateSecretError, match=f"set {STATE_SECRET_ENV}.*--no-state"):
        resolve_state_secret()
    with pytest.raises(MissingStateSecretError, match="at least 32"):
        resolve_state_secret("short")
    with pytest.raises(MissingStateSecretError, match="is the action signing key"):
        resolve_state_secret(SEED * 2, action_secret=SEED * 2)
    # nor what trainers are given: the public keys, or an old deployment's shared action secret
    for name, value in (
        ("RUNWATCH_ACTION_PUBLIC_KEYS", TRAINER_KEY),
        ("RUNWATCH_ACTION_SECRET", OLD_ACTION_SECRET),
    ):
        monkeypatch.setenv(name, value.decode())
        with pytest.raises(MissingStateSecretError, match=f"is {name}, which trainers are given"):
            resolve_state_secret(value)
    monkeypatch.setenv(STATE_SECRET_ENV, STATE_KEY.decode())
    assert resolve_state_secret(action_secret=SEED) == STATE_KEY
    # a processor with durable state takes no action key for its snapshots
    store = _Store()
    with pytest.raises(ValueError, match="state key"):
        TelemetryProcessor(CONFIG, SEED, state_reader=store)  # type: ignore[arg-type]
    with pytest.raises(MissingStateSecretError, match="is the action signing key"):
        TelemetryProcessor(CONFIG, SEED, state_reader=store, state_secret=SEED)  # type: ignore[arg-type]
    TelemetryProcessor(CONFIG, SEED, state_reader=None)  # (no durable state: no state key needed)
    with pytest.raises(ValueError, match="32-byte seed"):  # but a signing key, always
        TelemetryProcessor(CONFIG, b"short", state_reader=None)


def test_a_local_stack_keeps_a_state_key_of_its_own(tmp_path, monkeypatch):
    from runwatch.local.secret import STATE_SECRET_FILE, stack_action_keys, stack_state_secret

    for name in (STATE_SECRET_ENV, "RUNWATCH_ACTION_SIGNING_KEY", "RUNWATCH_ACTION_PUBLIC_KEYS"):
        monkeypatch.delenv(name, raising=False)
    keys = stack_action_keys(tmp_path)
    key = stack_state_secret(tmp_path, keys.seed)
    assert len(key) >= 32 and key.encode() != keys.seed
    assert stack_state_secret(tmp_path, keys.seed) == key  # kept
    assert (tmp_path / STATE_SECRET_FILE).stat().st_mode & 0o077 == 0  # readable by its owner only
    monkeypatch.setenv(STATE_SECRET_ENV, keys.public_keys.text)
    monkeypatch.setenv("RUNWATCH_ACTION_PUBLIC_KEYS", keys.public_keys.text)
    with pytest.raises(MissingStateSecretError, match="which trainers are given"):
        stack_state_secret(tmp_path, keys.seed)


if __name__ == "__main__":  # every name real snapshots reference, and whether it is admitted
    seen: dict[tuple[str, str], set[str]] = {}
    for source, data in all_real_snapshots():
        for ref in referenced_globals(data):
            seen.setdefault(ref, set()).add(source)
    for (module, name), sources in sorted(seen.items()):
        verdict = "admitted" if is_admitted(module, name) else "REFUSED"
        print(f"{verdict:9} {module}.{name}  ({', '.join(sorted(sources))})")


def test_a_snapshot_taken_before_the_modules_moved_still_reads():
    # (issue 41 moved the wire contract out of the producer and the worker out of `streams`: a worker
    # upgraded under running jobs reads their snapshots, taken by the old code)
    import io
    import pickle

    from runwatch.contract.schema import StepEvent
    from runwatch.worker.processor import RunState
    from runwatch.worker.state.classes import StateUnpickler, resolve

    event = StepEvent(run_id="r", step=3, loss=1.5)
    old = pickle.dumps(event, protocol=3).replace(  # (protocol 3: GLOBAL names the module as text)
        f"{type(event).__module__}\n".encode(), b"runwatch.producer.wire.schema\n"
    )
    assert b"runwatch.producer.wire.schema\n" in old
    assert StateUnpickler(io.BytesIO(old)).load() == event
    assert resolve("runwatch.streams.worker.processor", "RunState") is RunState
    for module, name in (
        ("runwatch.producer.wire.schema", "orjson"),
        ("runwatch.producer.wire.schema", "a.b"),
    ):
        assert not is_admitted(module, name)
