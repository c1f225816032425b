"""What a trainer's ActionListener costs its process: CPU (% of one core) and fetch requests per second, idle
(the run publishes nothing, for longer than the listener's active window) and while the run steps every 10 ms,
against the embedded broker. Each figure is the process with a listener less the same process without one.
Prints JSON. With ``--against REV``: REV's tree (a temporary worktree, its rooms first on ``PYTHONPATH``) and
this checkout's, in turn. Not part of the test suite.

    .venv/bin/python tests/benchmarks/bench_listener_cpu.py [--secs 10] [--against 3613505]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run as a script or imported)
from commit_tree import ROOT, commit_tree, rooms_path

IDLE_AFTER_S = 7.0  # past the listener's active window (5 s after the run last published)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(rw: Any, secs: float, step_every_s: float, fetches: list[int]) -> dict[str, float]:
    cpu0, fetched0, start = cpu_s(), fetches[0], time.monotonic()
    step = 0
    while time.monotonic() - start < secs:
        if step_every_s:
            rw.step(step, loss=1.0, grad_norm=1.0)
            step += 1
            time.sleep(step_every_s)
        else:
            time.sleep(0.2)
    elapsed = time.monotonic() - start
    return {
        "cpu_pct": round(100 * (cpu_s() - cpu0) / elapsed, 2),
        "fetches_per_s": round((fetches[0] - fetched0) / elapsed, 1),
    }


def one_tree(secs: float) -> dict[str, Any]:
    from kafka.consumer import fetcher

    fetches = [0]
    create = fetcher.Fetcher._create_fetch_requests

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        requests = create(self, *args, **kwargs)
        fetches[0] += len(requests)
        return requests

    fetcher.Fetcher._create_fetch_requests = counted  # type: ignore[method-assign]

    from runwatch.contract.signing import ActionSigningKey
    from runwatch.local.broker import EmbeddedBroker, ensure_topics
    from runwatch.producer import ActionListener, RunWatch

    sides: dict[str, dict[str, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker(log_path=Path(tmp) / "broker.log") as broker:
        ensure_topics(broker.bootstrap)
        key = ActionSigningKey.generate()
        for name in ("without_listener", "with_listener"):
            rw = RunWatch(f"cpu-{name}", broker.bootstrap, spool=False, collect_metadata=False)
            listener = None
            if name == "with_listener":
                listener = ActionListener(rw, public_keys=key.public.text, state_path=False)
                listener.wait_ready(10)
            rw.step(0, loss=1.0, grad_norm=1.0)
            time.sleep(IDLE_AFTER_S)
            idle = measure(rw, secs, 0, fetches)
            sides[name] = {"idle": idle, "stepping": measure(rw, secs, 0.01, fetches)}
            if listener is not None:
                listener.close()
            rw.close(timeout=2)
    with_, without = sides["with_listener"], sides["without_listener"]
    return {
        **sides,
        "listener_idle_cpu_pct": round(with_["idle"]["cpu_pct"] - without["idle"]["cpu_pct"], 2),
        "listener_idle_fetches_per_s": with_["idle"]["fetches_per_s"],
        "listener_stepping_cpu_pct": round(with_["stepping"]["cpu_pct"] - without["stepping"]["cpu_pct"], 2),
        "listener_stepping_fetches_per_s": with_["stepping"]["fetches_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--secs", type=float, default=10.0, help="each measurement's length")
    ap.add_argument("--against", help="an earlier commit to measure in turn with this checkout")
    args = ap.parse_args()
    if not args.against:
        print(json.dumps({"benchmark": "action_listener_cpu", "secs": args.secs, **one_tree(args.secs)}))
        return
    results = {}
    with commit_tree(args.against) as old:
        for name, tree in ((args.against, old), ("checkout", ROOT)):
            env = {**os.environ, "PYTHONPATH": rooms_path(tree)}
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--secs", str(args.secs)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
            ).stdout
            results[name] = json.loads(out)
    print(json.dumps({"benchmark": "action_listener_cpu_against_a_commit", **results}, indent=2))


if __name__ == "__main__":
    main()
