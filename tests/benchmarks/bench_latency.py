"""Detection latency through the whole pipeline: a faulty step published by the trainer to the
action reaching the trainer's ActionListener, over many runs. Prints JSON (p50/p99).

Real parts: the embedded Tansu broker, a `runwatch worker` process, RunWatch and ActionListener.
Each run warms up with healthy steps, then publishes one step with a NaN loss; the worker's
non-finite detector finds it and the policy sends an (signed) alert, which the listener accepts.

    .venv/bin/python tests/benchmarks/bench_latency.py [--runs 40]
    RUNWATCH_FETCH_MAX_WAIT_MS=1500 .venv/bin/python tests/benchmarks/bench_latency.py   # Faust's own wait
    RUNWATCH_ACTIONS_FETCH_WAIT_MS=10 .venv/bin/python tests/benchmarks/bench_latency.py  # the listener's
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from runwatch.contract.signing import ActionSigningKey
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.worker_process import WorkerProcess
from runwatch.producer import ActionListener, RunWatch
from runwatch.producer.actions.reader import FETCH_WAIT_MS as LISTENER_FETCH_WAIT_MS


def one_run(bootstrap: str, public_keys: str, index: int, warmup_steps: int, timeout: float) -> float | None:
    rw = RunWatch(f"latency-{index}-{secrets.token_hex(3)}", bootstrap, spool=False, collect_metadata=False)
    listener = ActionListener(rw, public_keys=public_keys)
    try:
        if not listener.wait_ready(10):
            raise RuntimeError("the action listener did not get its partitions")
        for step in range(warmup_steps):
            rw.step(step, loss=1.0 + 0.01 * (step % 3), grad_norm=1.0)
            time.sleep(0.002)
        time.sleep(0.3)  # the warm-up is processed; what follows measures one event's path
        started = time.perf_counter()
        rw.step(warmup_steps, loss=float("nan"), grad_norm=float("nan"))
        deadline = started + timeout
        while time.perf_counter() < deadline:
            if listener.poll(warmup_steps):
                return time.perf_counter() - started
            time.sleep(0.001)
        return None
    finally:
        listener.close()
        rw.close(timeout=2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--warmup-steps", type=int, default=25)
    ap.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args()
    keys = ActionSigningKey.generate()  # the worker's; the trainers get its public key
    latencies: list[float] = []
    missed = 0
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        worker = WorkerProcess(broker.bootstrap, keys, Path(tmp) / "worker.log")
        try:
            worker.wait_ready(90)
            for i in range(args.runs):
                latency = one_run(broker.bootstrap, keys.public.text, i, args.warmup_steps, args.timeout)
                if latency is None:
                    missed += 1
                else:
                    latencies.append(latency)
        finally:
            worker.stop()
    ordered = sorted(latencies)
    # (read as worker/runwatch/worker/transport.py reads it: importing it would load Faust into this process)
    active_wait_ms = max(1, int(os.environ.get("RUNWATCH_ACTIVE_FETCH_MAX_WAIT_MS", "5")))

    def pct(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1) if ordered else None

    print(
        json.dumps(
            {
                "benchmark": "detection_latency_faulty_step_to_trainer",
                "runs": args.runs,
                "missed": missed,
                "fetch_max_wait_ms": int(os.environ.get("RUNWATCH_FETCH_MAX_WAIT_MS", "50")),
                # (the waits in effect on this path: the worker's while telemetry arrives, the listener's
                # while its run publishes; docs/profiles/worker.md)
                "active_fetch_max_wait_ms": active_wait_ms,
                "listener_fetch_wait_ms": LISTENER_FETCH_WAIT_MS,
                "p50_ms": pct(0.5),
                "p99_ms": pct(0.99),
                "max_ms": round(ordered[-1] * 1e3, 1) if ordered else None,
                "mean_ms": round(statistics.fmean(ordered) * 1e3, 1) if ordered else None,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
