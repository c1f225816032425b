"""The node-local stop relay (producer/runwatch/producer/actions/stop_relay.py): a stop the node's reader
received arms the watchdog of the node's other ranks, once; a marker of an earlier job or attempt, or of
another run, does not."""

from __future__ import annotations

import os
import threading
import time

from runwatch.producer.actions.stop_relay import StopRelay


def armed_within(relay: StopRelay, timeout: float, since: float | None = None) -> bool:
    fired = threading.Event()
    relay.watch(fired.set, since=since)
    try:
        return fired.wait(timeout)
    finally:
        relay.close()


def test_a_stop_signalled_on_the_node_arms_the_other_ranks(tmp_path):
    reader, other = StopRelay("run-1", tmp_path), StopRelay("run-1", tmp_path)
    threading.Timer(0.3, reader.signal, args=("stop-1",)).start()
    assert armed_within(other, 5.0)
    assert reader.path.read_text() == "stop-1"
    assert not list(tmp_path.glob("*.part"))  # (written whole, then renamed)


def test_a_marker_of_an_earlier_job_or_another_run_is_not_taken(tmp_path):
    old = StopRelay("run-1", tmp_path)
    old.signal("stop-old")
    past = time.time() - 3600
    os.utime(old.path, (past, past))
    assert not armed_within(StopRelay("run-1", tmp_path), 1.5)  # (older than the listener)
    StopRelay("run-2", tmp_path).signal("stop-run2")
    assert not armed_within(StopRelay("run-1", tmp_path), 1.5, since=time.time() - 0.5)
    assert len({p.name for p in tmp_path.iterdir()}) == 2  # one marker per run


def test_a_folder_that_cannot_be_written_is_a_warning_not_an_error(tmp_path, caplog):
    StopRelay("run-1", tmp_path / "missing" / "folder").signal("stop-1")
    assert "cannot pass a stop" in caplog.text
