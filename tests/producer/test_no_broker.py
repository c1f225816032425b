"""With no broker reachable, a real training loop runs unhindered: construction returns at
once, publishing never blocks or raises, and close() is bounded and accounts for every event: each
one is in the disk spool, to be replayed when the run restarts with a broker. And a broker that
comes up a moment after the run started gets the run's first events, even with no spool."""

from __future__ import annotations

import time

import pytest
import torch

from runwatch.contract import topics
from runwatch.contract.schema import decode_event
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.producer import ActionListener, RunWatch
from tests.conftest import read_topic
from tests.support.action_keys import UNIT

pytestmark = pytest.mark.integration


def test_training_loop_is_not_blocked_without_a_broker(tmp_path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens here
    t0 = time.perf_counter()
    rw = RunWatch("no-broker-run", dead, max_block_ms=200, spool_dir=tmp_path / "spool")
    listener = ActionListener(rw, public_keys=UNIT.public_text)
    construct_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    publish_s = []
    steps = 200
    for step in range(1, steps + 1):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = time.perf_counter()
        rw.step(step, loss=loss.item(), grad_norm=1.0)
        publish_s.append(time.perf_counter() - t)
        assert listener.poll(step) == []

    # A blocking send would cost max_block_ms (200 ms) per call: 40 s for the loop.
    assert construct_s < 1.0
    assert sum(publish_s) < 1.0
    t = time.perf_counter()
    stats = rw.close(timeout=2.0)
    assert time.perf_counter() - t < 8.0
    listener.close()
    offered = steps + 2  # run_start and run_end
    assert stats.published == 0
    assert stats.dropped == 0 and stats.drop_reasons == {}
    assert stats.spooled == stats.spooled_at_close == offered
    assert any((tmp_path / "spool").glob("*.seg"))


def test_a_broker_that_comes_up_after_the_run_started_gets_its_first_events(tmp_path):
    """The first send needs the topic's metadata; a client that gives up after ``max_block_ms``
    (100 ms) would drop rank 0's run_start, which tells the worker the world size, where there is no
    spool. The publisher's thread waits for the metadata up to the delivery timeout instead."""
    port = free_port()
    rw = RunWatch(
        "late-broker-run",
        f"127.0.0.1:{port}",
        world_size=3,
        collect_metadata=False,
        spool=False,
        delivery_timeout_ms=20_000,
    )  # run_start is queued now, before any broker listens
    time.sleep(1.0)  # well past max_block_ms
    with EmbeddedBroker(port=port, log_path=tmp_path / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        rw.step(0, loss=1.0)
        stats = rw.close(timeout=15.0)
        assert stats.dropped == 0 and stats.drop_reasons == {}, stats
        assert stats.published == 3  # run_start, the step, run_end
        mine = read_topic(
            broker.bootstrap,
            topics.TELEMETRY,
            lambda records: sum(b"late-broker-run" in r.value for r in records) >= 3,
        )
        kinds = [e.kind for e in (decode_event(r.value) for r in mine) if e.run_id == "late-broker-run"]
        assert kinds == ["run_start", "step", "run_end"]
