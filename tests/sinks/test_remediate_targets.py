"""Remediation targets the platform can trust (issue 11, item 10), with the real broker, the real
embedded ClickHouse and real programs: a stand-in scheduler (`squeue -h -j JOB -w HOST -o %k`) and
cluster (`kubectl get pod POD -o jsonpath=...`) that print the run id set at launch, and commands
that leave a marker line when they run.

- A run that declares another team's job, host and pod (in its run_start, or in the action's params
  as the worker copies them) gets nothing run against them: rows `unverified`, the reason recorded.
- A run whose targets verify as its own gets each command run once, although the action arrives
  twice; a run the platform's targets file maps gets the mapped targets, whatever it declared.
- `@/etc/passwd`, `file:///x`, `/etc/passwd` and `http://x` as job_id, host or pod are refused
  (rows `refused`, with the reason) before the command that uses them or its verify command runs.
"""

from __future__ import annotations

import json
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey, sign_action
from runwatch.producer import RunStartEvent
from runwatch.sinks import ClickHouseSink
from runwatch.sinks.remediate.config import load_remediation_config
from runwatch.sinks.remediate.consumer import RemediateConsumer
from runwatch.sinks.remediate.record import RemediationStore
from tests.conftest import eventually, publish_actions
from tests.support.action_keys import ActionKeys

pytestmark = pytest.mark.integration

# A command's stand-in: appends its arguments as one line to the marker file (argv[1]).
MARKER = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))"
# `squeue -h -j JOB -w HOST -o %k`: logs the call, then prints the job's comment if it runs on HOST
# (nothing if not), or fails for an unknown job.
SQUEUE = (
    "import json, sys\n"
    "table, log, action, job, host = sys.argv[1:6]\n"
    "open(log, 'a').write(' '.join(['squeue', action, job, host]) + chr(10))\n"
    "entry = json.load(open(table)).get(job)\n"
    "if entry is None:\n"
    "    sys.exit(print('slurm_load_jobs error: Invalid job id specified', file=sys.stderr) or 1)\n"
    "if entry['host'] == host:\n"
    "    print(entry['comment'])\n"
)
# `kubectl get pod POD -o jsonpath=...runwatch/run-id`: logs the call, prints the pod's label.
KUBECTL = (
    "import json, sys\n"
    "table, log, action, pod = sys.argv[1:5]\n"
    "open(log, 'a').write(' '.join(['kubectl', action, pod]) + chr(10))\n"
    "label = json.load(open(table)).get(pod)\n"
    "if label is None:\n"
    "    sys.exit(print('Error from server (NotFound): pods ' + repr(pod) + ' not found', "
    "file=sys.stderr) or 1)\n"
    "print(label)\n"
)


class Platform:
    """The stand-in scheduler and cluster, the platform's targets file and the remediation config."""

    def __init__(self, root: Path, jobs: dict, pods: dict, targets: dict):
        self.marker = root / "ran.txt"
        self.verify_log = root / "verify.log"
        (root / "jobs.json").write_text(json.dumps(jobs))
        (root / "pods.json").write_text(json.dumps(pods))
        (root / "targets.yaml").write_text(yaml.safe_dump(targets))
        self.config_path = root / "remediation.yaml"
        self.config_path.write_text(
            yaml.safe_dump(
                {
                    "vars": {"marker": str(self.marker), "verify_log": str(self.verify_log)},
                    "targets_file": str(root / "targets.yaml"),
                    "rules": [
                        {
                            "kinds": ["stop"],
                            "commands": [
                                {
                                    "argv": [
                                        sys.executable,
                                        "-c",
                                        MARKER,
                                        "{marker}",
                                        "scancel",
                                        "{action_id}",
                                        "{job_id}",
                                        "{host}",
                                    ],
                                    "timeout_s": 20,
                                    "verify": {
                                        "argv": [
                                            sys.executable,
                                            "-c",
                                            SQUEUE,
                                            str(root / "jobs.json"),
                                            "{verify_log}",
                                            "{action_id}",
                                            "{job_id}",
                                            "{host}",
                                        ],
                                        "timeout_s": 20,
                                    },
                                },
                                {
                                    "argv": [
                                        sys.executable,
                                        "-c",
                                        MARKER,
                                        "{marker}",
                                        "delete-pod",
                                        "{action_id}",
                                        "{pod}",
                                    ],
                                    "timeout_s": 20,
                                    "verify": {
                                        "argv": [
                                            sys.executable,
                                            "-c",
                                            KUBECTL,
                                            str(root / "pods.json"),
                                            "{verify_log}",
                                            "{action_id}",
                                            "{pod}",
                                        ],
                                        "timeout_s": 20,
                                    },
                                },
                            ],
                        }
                    ],
                }
            )
        )
        self.config = load_remediation_config(self.config_path)
        self.scancel, self.delete_pod = self.config.commands_for("stop")

    @staticmethod
    def _lines(path: Path) -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    def ran(self, action_id: str) -> list[str]:
        return [line for line in self._lines(self.marker) if line.split()[1] == action_id]

    def verified(self, action_id: str) -> list[str]:
        return [line for line in self._lines(self.verify_log) if line.split()[1] == action_id]


def _action(run_id: str, key: ActionSigningKey, **params) -> Action:
    now = utc_now()
    action = Action(
        action_id=f"stop-{uuid.uuid4().hex[:12]}",
        run_id=run_id,
        kind="stop",
        reason="non-finite loss for 3 step(s)",
        step=12,
        params=params,
        issued_at=now,
        expires_at=now + timedelta(seconds=300),
    )
    return sign_action(action, key)


def _remediate(
    platform: Platform,
    public_keys: ActionPublicKeys,
    store: RemediationStore,
    bootstrap: str,
    actions: list[Action],
    deliveries: list[Action],
) -> RemediateConsumer:
    """Publish ``deliveries`` and consume until both commands of every action are recorded."""
    consumer = RemediateConsumer(
        platform.config, public_keys, store, bootstrap, group_id=f"rem-targets-{uuid.uuid4().hex[:8]}"
    )
    thread = threading.Thread(target=consumer.run, daemon=True)
    thread.start()
    keys = [platform.scancel.key(), platform.delete_pod.key()]
    try:
        publish_actions(bootstrap, deliveries)
        done = consumer.remediator.done  # written by the consumer's thread; membership tests only
        eventually(
            lambda: all((a.action_id, k) in done for a in actions for k in keys),
            60,
            "both commands of every action to be recorded",
        )
    finally:
        consumer.stopping.set()
        thread.join(20)
    assert not thread.is_alive()
    return consumer


def _rows(store: RemediationStore, action: Action) -> dict[str, dict]:
    """The action's command rows by the command they stand for."""
    rows = store.executions(action.action_id)
    assert len(rows) == 2, rows
    return {("scancel" if r["argv"][4] == "scancel" else "delete-pod"): r for r in rows}


def test_a_run_cannot_aim_commands_at_another_teams_targets(broker, chdb_dsn, tmp_path):
    keys = ActionKeys.generate()  # our own: other tests' actions on the topic are not ours to run
    tag = uuid.uuid4().hex[:8]
    victim, attacker, honest, mapped = (f"{team}-{tag}" for team in ("team-b", "team-a", "team-l", "team-m"))
    platform = Platform(
        tmp_path,
        jobs={
            "5001": {"host": "node-b", "comment": victim},
            "5002": {"host": "node-l", "comment": honest},
            "5003": {"host": "node-m", "comment": mapped},
        },
        pods={"b-trainer-0": victim, "l-trainer-0": honest, "m-trainer-0": mapped},
        targets={mapped: {"job_id": 5003, "host": "node-m", "pod": "m-trainer-0"}},
    )
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    store = RemediationStore(sink)
    # What each run declares about itself, as `runwatch sink` stores it.
    sink.writer.write_events(
        [
            # team b's
            RunStartEvent(run_id=attacker, job_id="5001", host="node-b", tags={"pod": "b-trainer-0"}),
            RunStartEvent(run_id=honest, job_id="5002", host="node-l", tags={"pod": "l-trainer-0"}),
            # overridden
            RunStartEvent(run_id=mapped, job_id="5001", host="node-b", tags={"pod": "b-trainer-0"}),
        ]
    )

    from_run_start = _action(attacker, keys.signing)
    # The worker copies run_start's job_id/host/pod into the signed params: signed, still self-declared.
    from_params = _action(attacker, keys.signing, job_id="5001", host="node-b", pod="b-trainer-0")
    verified = _action(honest, keys.signing)
    by_mapping = _action(mapped, keys.signing, job_id="5001", host="node-b", pod="b-trainer-0")
    actions = [from_run_start, from_params, verified, by_mapping]
    try:
        consumer = _remediate(
            platform,
            keys.public,
            store,
            broker.bootstrap,
            actions,
            [from_run_start, from_params, verified, by_mapping, verified],
        )  # twice

        for action in (from_run_start, from_params):
            assert platform.ran(action.action_id) == []  # nothing ran against team b's job or pod
            assert len(platform.verified(action.action_id)) == 2  # both were asked about, and said no
            rows = _rows(store, action)
            assert {r["status"] for r in rows.values()} == {"unverified"}
            assert rows["scancel"]["argv"][-2:] == ["5001", "node-b"] and rows["scancel"]["exit_code"] is None
            assert f"printed '{victim}', not the run id '{attacker}'" in rows["scancel"]["output"]
            assert f"printed '{victim}', not the run id '{attacker}'" in rows["delete-pod"]["output"]

        assert sorted(platform.ran(verified.action_id)) == [
            f"delete-pod {verified.action_id} l-trainer-0",
            f"scancel {verified.action_id} 5002 node-l",
        ]
        assert {(r["status"], r["exit_code"]) for r in _rows(store, verified).values()} == {("ok", 0)}
        assert len(platform.verified(verified.action_id)) == 2  # once each, not again for the duplicate

        assert sorted(platform.ran(by_mapping.action_id)) == [
            f"delete-pod {by_mapping.action_id} m-trainer-0",
            f"scancel {by_mapping.action_id} 5003 node-m",
        ]
        assert {r["status"] for r in _rows(store, by_mapping).values()} == {"ok"}

        rem = consumer.remediator
        assert rem.executed == {"unverified": 4, "ok": 4} and rem.ignored["duplicate"] >= 1
    finally:
        sink.close()


BAD_VALUES = [
    ("@/etc/passwd", "contains '@'"),
    ("file:///x", "looks like a URL"),
    ("/etc/passwd", "is an absolute path"),
    ("http://x", "looks like a URL"),
]


def test_paths_urls_and_at_signs_are_refused_as_targets(broker, chdb_dsn, tmp_path):
    keys = ActionKeys.generate()  # our own: other tests' actions on the topic are not ours to run
    tag = uuid.uuid4().hex[:8]
    good = {"job_id": "6001", "host": "node-x", "pod": "x-trainer-0"}
    cases = []  # (run_id, field, value, reason, what the run declares)
    for field in ("job_id", "host", "pod"):
        for i, (value, reason) in enumerate(BAD_VALUES):
            run_id = f"inject-{field.replace('_', '')}-{i}-{tag}"
            declared = {**good, field: value}
            cases.append((run_id, field, value, reason, declared))
    platform = Platform(tmp_path, jobs={}, pods={}, targets={})
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    store = RemediationStore(sink)
    actions = []
    events = []
    for n, (run_id, _field, _value, _reason, declared) in enumerate(cases):
        if n % 2:  # half declared in run_start (field, or the pod tag), half in the signed params
            actions.append(_action(run_id, keys.signing, **declared))
        else:
            events.append(
                RunStartEvent(
                    run_id=run_id,
                    job_id=declared["job_id"],
                    host=declared["host"],
                    tags={"pod": declared["pod"]},
                )
            )
            actions.append(_action(run_id, keys.signing))
    sink.writer.write_events(events)
    try:
        _remediate(platform, keys.public, store, broker.bootstrap, actions, actions)
        for action, (_run_id, field, value, reason, _declared) in zip(actions, cases, strict=True):
            refused = "delete-pod" if field == "pod" else "scancel"
            row = _rows(store, action)[refused]
            assert row["status"] == "refused", (field, value, row)
            assert row["output"].startswith(f"{{{field}}} = {value!r} {reason}"), row["output"]
            # the template: nothing filled
            assert row["argv"][-1] == ("{pod}" if field == "pod" else "{host}")
            assert not any(value in line for line in platform.ran(action.action_id))
            # verify never saw it
            assert not any(value in line for line in platform.verified(action.action_id))
    finally:
        sink.close()
