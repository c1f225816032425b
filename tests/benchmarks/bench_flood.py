"""One run floods its partition; how long is another run on that partition kept waiting? (issue 35, item 8)

Each round starts its own embedded broker and ``runwatch worker``; a victim run with a confirmed-good
checkpoint steps, then a flood of ``--flood`` step events of another run on the victim's partition is sent
as fast as kafka-python sends, then the victim's NaN streak. Printed: the time from the victim's last NaN
sent to its rollback on the action topic, with the per-run budget on (the default config) and off
(``runs.budget_events_per_s: 0``, the behaviour before the budget), in the same session.

    .venv/bin/python tests/benchmarks/bench_flood.py [--flood 200000] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2])
)  # (tests.support.flood_scenario, run as a script)

from runwatch.contract.signing import ActionSigningKey
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from tests.support.flood_scenario import run_flood

CONFIGS = {"budget_on": {}, "budget_off": {"runs": {"budget_events_per_s": 0}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flood", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    key = ActionSigningKey.generate()
    rounds = []
    for r in range(args.rounds):
        for name in list(CONFIGS) if r % 2 == 0 else list(CONFIGS)[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                with EmbeddedBroker(log_path=folder / "broker.log") as broker:
                    ensure_topics(broker.bootstrap)
                    config = CONFIGS[name]
                    outcome = run_flood(broker.bootstrap, key, folder, config, args.flood, args.timeout)
            c = outcome.counters
            row = {
                "config": name,
                "flood_events": outcome.flood_events,
                "flood_send_s": outcome.flood_send_s,
                "victim_rollback_delay_s": outcome.delay_s,
                "victim_actions": outcome.rollback_kinds,
                "events_processed": c["processed"],
                "events_shed": c["events_shed"],
            }
            rounds.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"flood_events": args.flood, "rounds": rounds}, default=str))


if __name__ == "__main__":
    main()
