"""bench_state.py's one worker against two in one group: real worker processes (started as
``bench_state.py --worker``), a fresh group and broker each time, the telemetry topic filled once the
workers have split the partitions; the group's rate from when its workers handed on their events."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

# (beside this file: bench_state.py, which imports this module, puts this folder on sys.path)
from state_bench_events import PARTITIONS, SECRET, STATE_SECRET, stream

from runwatch.contract import topics
from runwatch.detectors import RunwatchConfig
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.worker.state.run_states import StateOptions

# The script whose hidden --worker option runs worker_process in a process of its own
BENCH_STATE = Path(__file__).resolve().with_name("bench_state.py")


# -- one worker against two ------------------------------------------------------------------------


def worker_process(bootstrap: str, group: str, state: str, out: str, ready: str) -> None:
    """A worker (create_app) that writes, per partition, when it handed its first and last event to
    its detector process and the newest offset, to ``out`` every 0.2 s."""
    import asyncio

    from faust.worker import Worker

    from runwatch.worker.app import create_app

    app, detectors = create_app(
        bootstrap,
        RunwatchConfig(),
        SECRET,
        app_id=group,
        web_port=free_port(),
        ready_file=Path(ready),
        state=StateOptions(enabled=state == "on"),
        state_secret=STATE_SECRET,
    )
    seen: dict[int, list] = {}
    submit = detectors.submit

    def timed_submit(kind, payload=None):
        reply = submit(kind, payload)
        if kind == "events":

            def done(_f) -> None:
                now = time.time()
                for _v, _k, p, o, _ts in payload:
                    entry = seen.setdefault(p, [now, now, o, 0])
                    entry[1], entry[2], entry[3] = now, max(entry[2], o), entry[3] + 1

            reply.add_done_callback(done)
        return reply

    detectors.submit = timed_submit

    @app.timer(0.2)
    async def write() -> None:
        Path(out).write_text(json.dumps(seen))
        await asyncio.sleep(0)

    sys.argv = [sys.argv[0]]
    Worker(app, loglevel="WARNING", quiet=True).execute_from_commandline()


def fill(bootstrap: str, n: int, runs: int) -> dict[int, int]:
    from kafka import KafkaProducer

    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        api_version=topics.KAFKA_API_VERSION,
        acks=1,
        linger_ms=20,
        batch_size=256 * 1024,
    )
    futures = [
        producer.send(topics.TELEMETRY, key=key, value=value)
        for value, key, _ in stream(runs, n // runs, seed=3)
    ]
    producer.flush(timeout=120)
    last: dict[int, int] = {}
    for f in futures:
        md = f.get(timeout=30)
        last[md.partition] = max(last.get(md.partition, -1), md.offset)
    producer.close()
    return last


def group_rate(workers: int, state: str, events: int, runs: int, tmp: Path, timeout: float) -> float:
    """Events/s of ``workers`` workers in one group, on a broker of their own (a fresh group reads from the
    earliest offset: an empty topic is the only way it reads just these events)."""
    with EmbeddedBroker(log_path=tmp / f"broker-{secrets.token_hex(3)}.log") as broker:
        ensure_topics(broker.bootstrap, partitions=PARTITIONS)
        return _group_rate(broker.bootstrap, workers, state, events, runs, tmp, timeout)


def _group_rate(
    bootstrap: str, workers: int, state: str, events: int, runs: int, tmp: Path, timeout: float
) -> float:
    group = f"bench-state-{secrets.token_hex(4)}"
    procs, outs, readies = [], [], []
    try:
        for w in range(workers):
            out, ready = tmp / f"{group}-{w}.json", tmp / f"{group}-{w}.ready"
            outs.append(out)
            readies.append(ready)
            procs.append(
                subprocess.Popen(
                    [sys.executable, BENCH_STATE, "--worker", bootstrap, group, state, str(out), str(ready)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    cwd=tmp,
                )
            )
        deadline = time.monotonic() + timeout

        def assigned() -> list[set[str]]:
            return [set(r.read_text().split(",")) - {""} if r.exists() else set() for r in readies]

        telemetry = {f"{topics.TELEMETRY}:{p}" for p in range(PARTITIONS)}
        while True:  # every worker holds some partitions and together they hold them all, once
            got = assigned()
            if (
                all(got)
                and set().union(*got) >= telemetry
                and sum(len(g & telemetry) for g in got) == PARTITIONS
            ):
                break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the workers did not split the partitions: {got}")
            time.sleep(0.2)
        time.sleep(2)  # (settled)
        ends = fill(bootstrap, events, runs)
        while True:
            seen: dict[str, list] = {}
            for out in outs:
                if out.exists():
                    try:
                        seen.update(json.loads(out.read_text()))
                    except ValueError:
                        pass  # (being written)
            if all(str(p) in seen and seen[str(p)][2] >= end for p, end in ends.items()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not finish within {timeout} s: {seen} vs {ends}")
            time.sleep(0.2)
        first = min(v[0] for v in seen.values())
        last = max(v[1] for v in seen.values())
        counted = sum(v[3] for v in seen.values())
        if counted != events:
            raise RuntimeError(f"the workers handed on {counted} events, not the {events} published")
        return events / (last - first)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
