"""`runwatch remediate` against the real broker, the real embedded ClickHouse, a real local HTTP
server as the chat webhook and a real command (verified by a stand-in scheduler): a signed action
delivered twice runs its command and posts once, a forged one and a future-dated one do nothing, every
execution is recorded, and a restarted remediator does not repeat what is recorded. Targets that are not the
run's and unsafe values: test_remediate_targets.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from runwatch.contract import topics
from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import ActionSigningKey, sign_action
from runwatch.producer import RunStartEvent
from runwatch.sinks import ClickHouseSink
from runwatch.sinks.remediate.config import load_remediation_config
from runwatch.sinks.remediate.consumer import RemediateConsumer
from runwatch.sinks.remediate.record import RemediationStore
from tests.conftest import eventually, publish_actions
from tests.support.action_keys import ActionKeys, forgeries, trainer_materials

pytestmark = pytest.mark.integration

# an old deployment's shared RUNWATCH_ACTION_SECRET, still in a trainer's environment
OLD_SECRET = "0123456789abcdef" * 4

# Appends its arguments as one line to the marker file: proof of each run, no shell involved.
MARKER_SCRIPT = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))"
# A stand-in for `squeue -h -j JOB -w HOST -o %k`: the comment the job was launched with (the run
# id), nothing if the job is not on that host, an error for an unknown job.
SQUEUE_SCRIPT = (
    "import json, sys\n"
    "job = json.load(open(sys.argv[1])).get(sys.argv[2])\n"
    "if job is None:\n"
    "    sys.exit(print('slurm_load_jobs error: Invalid job id specified', file=sys.stderr) or 1)\n"
    "if job['host'] == sys.argv[3]:\n"
    "    print(job['comment'])\n"
)


class Webhook:
    """A real HTTP server on a free loopback port that keeps every JSON body POSTed to it."""

    def __init__(self):
        self.posts: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hook.posts.append(
                    {
                        "path": self.path,
                        "content_type": self.headers.get("Content-Type"),
                        "json": json.loads(body),
                    }
                )
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/secret-token"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_exc):
        self.server.shutdown()
        self.server.server_close()

    def for_action(self, action_id: str) -> list[dict]:
        return [p for p in self.posts if p["json"].get("runwatch", {}).get("action_id") == action_id]


def _write_config(tmp_path: Path, hook_url: str, marker: Path, jobs: dict[str, dict[str, str]]) -> Path:
    """``jobs``: the stand-in scheduler's jobs, job id -> {host, comment}."""
    jobs_file = tmp_path / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    path = tmp_path / "remediation.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "vars": {"marker": str(marker)},
                "rules": [
                    {
                        "kinds": ["stop"],
                        "commands": [
                            {
                                "argv": [
                                    sys.executable,
                                    "-c",
                                    MARKER_SCRIPT,
                                    "{marker}",
                                    "{action_id}",
                                    "{job_id}",
                                    "{host}",
                                ],
                                "timeout_s": 20,
                                "verify": {
                                    "argv": [
                                        sys.executable,
                                        "-c",
                                        SQUEUE_SCRIPT,
                                        str(jobs_file),
                                        "{job_id}",
                                        "{host}",
                                    ],
                                    "timeout_s": 20,
                                },
                            },
                        ],
                    }
                ],
                "webhooks": [{"url": hook_url, "kinds": ["stop", "alert"]}],
            }
        )
    )
    return path


def _action(run_id: str, kind: str, key: ActionSigningKey, **params) -> Action:
    now = utc_now()
    action = Action(
        action_id=f"{kind}-{uuid.uuid4().hex[:12]}",
        run_id=run_id,
        kind=kind,
        reason="non-finite loss for 3 step(s)",
        step=12,
        params=params,
        issued_at=now,
        expires_at=now + timedelta(seconds=120),
    )
    return sign_action(action, key)


def _marker_lines(marker: Path, action_id: str) -> list[str]:
    if not marker.exists():
        return []
    return [line for line in marker.read_text().splitlines() if line.split()[0] == action_id]


def test_action_delivered_twice_runs_and_posts_once_and_is_recorded(broker, chdb_dsn, tmp_path):
    keys = ActionKeys.generate()  # our own: other tests' actions on the topic are not ours to run
    run_id = f"remediate-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "ran.txt"
    sink = ClickHouseSink(chdb_dsn)
    sink.migrate()
    # The run's metadata, as `runwatch sink` stores it: where {job_id} and {host} come from.
    sink.writer.write_events([RunStartEvent(run_id=run_id, job_id="4242", host="node-7.cluster")])
    store = RemediationStore(sink)

    stop = _action(run_id, "stop", keys.signing)
    forged = _action(run_id, "stop", ActionSigningKey.generate())  # another key pair's
    # A stop signed with everything a trainer holds (the public key, an old shared HMAC secret): none signs
    by_trainer = forgeries(
        _action(run_id, "stop", keys.signing).model_copy(update={"signature": ""}),
        trainer_materials(keys.public_text, OLD_SECRET),
        keys.signing.key_id,
    )
    # signed, but dated an hour ahead: the trainer's listener refuses it, so must the remediator (issue 23)
    ahead = utc_now() + timedelta(hours=1)
    future = sign_action(
        _action(run_id, "stop", keys.signing).model_copy(
            update={"issued_at": ahead, "expires_at": ahead + timedelta(seconds=120), "signature": ""}
        ),
        keys.signing,
    )
    # same partition, after the rest: all handled when it is
    sentinel = _action(run_id, "alert", keys.signing)

    with Webhook() as hook:
        config = load_remediation_config(
            _write_config(tmp_path, hook.url, marker, {"4242": {"host": "node-7.cluster", "comment": run_id}})
        )
        consumer = RemediateConsumer(config, keys.public, store, broker.bootstrap, group_id=f"rem-{run_id}")
        thread = threading.Thread(target=consumer.run, daemon=True)
        thread.start()
        try:
            # the stop arrives twice
            publish_actions(broker.bootstrap, [stop, forged, *by_trainer, future, stop, sentinel])
            eventually(lambda: hook.for_action(sentinel.action_id), 30, "the sentinel action's webhook post")
        finally:
            consumer.stopping.set()
            thread.join(15)

        assert _marker_lines(marker, stop.action_id) == [f"{stop.action_id} 4242 node-7.cluster"]
        assert _marker_lines(marker, forged.action_id) == [] == _marker_lines(marker, future.action_id)
        forged_by_trainer = by_trainer[0].action_id  # the trainer's forged stop: no remediation
        assert _marker_lines(marker, forged_by_trainer) == []
        assert hook.for_action(forged_by_trainer) == [] and store.executions(forged_by_trainer) == []
        posts = hook.for_action(stop.action_id)
        assert len(posts) == 1
        post = posts[0]
        assert post["path"] == "/services/T0/B0/secret-token" and post["content_type"] == "application/json"
        assert post["json"]["text"].startswith(f"runwatch *stop* for run `{run_id}` at step 12")
        fields = {f["title"]: f["value"] for f in post["json"]["attachments"][0]["fields"]}
        assert (
            fields["run_id"] == run_id
            and fields["kind"] == "stop"
            and fields["command"].endswith("ok (exit 0)")
        )
        assert hook.for_action(forged.action_id) == []
        rem = consumer.remediator
        assert (
            rem.ignored["bad_signature"] >= 1 + len(by_trainer)
            and rem.ignored["duplicate"] >= 1
            and rem.ignored["future"] == 1
        )
        assert hook.for_action(future.action_id) == [] and store.executions(future.action_id) == []

        rows = store.executions(stop.action_id)
        assert sorted((r["target"], r["status"], r["exit_code"]) for r in rows) == [
            ("command", "ok", 0),
            ("webhook", "ok", 200),
        ]
        command = next(r for r in rows if r["target"] == "command")
        assert (
            command["argv"][-3:] == [stop.action_id, "4242", "node-7.cluster"] and command["run_id"] == run_id
        )
        webhook = next(r for r in rows if r["target"] == "webhook")
        assert "secret-token" not in webhook["url"]  # a chat webhook's path is its credential
        assert [r["target"] for r in store.executions(sentinel.action_id)] == ["webhook"]
        assert store.executions(forged.action_id) == []

        # A restarted remediator (fresh memory, re-reading the topic from the start) repeats nothing.
        restarted = RemediateConsumer(config, keys.public, store, broker.bootstrap, group_id=f"rem2-{run_id}")
        thread = threading.Thread(target=restarted.run, daemon=True)
        thread.start()
        try:
            eventually(
                lambda: restarted.remediator.ignored["duplicate"] >= 3, 30, "the restart to see all three"
            )
        finally:
            restarted.stopping.set()
            thread.join(15)
        assert len(_marker_lines(marker, stop.action_id)) == 1
        assert len(hook.for_action(stop.action_id)) == 1 and len(hook.for_action(sentinel.action_id)) == 1
        assert len(store.executions(stop.action_id)) == 2
    sink.close()


def test_remediate_command_line(broker, tmp_path):
    """The `runwatch remediate` process itself: needs the workers' public key, runs once per action, stops on
    SIGTERM."""
    keys = ActionKeys.generate()
    run_id = f"remediate-cli-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "ran.txt"
    with Webhook() as hook:
        config = _write_config(tmp_path, hook.url, marker, {"777": {"host": "gpu-3", "comment": run_id}})
        args = [
            sys.executable,
            "-m",
            "runwatch.cli",
            "remediate",
            "--bootstrap",
            broker.bootstrap,
            "--config",
            str(config),
            "--dsn",
            f"chdb://{tmp_path / 'clickhouse'}",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNWATCH_ACTION_")}
        refused = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and topics.PUBLIC_KEYS_ENV in refused.stderr
        # the workers' private key is not what it takes: it verifies with the public key alone
        refused = subprocess.run(
            args, env={**env, **keys.worker_env}, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode != 0 and topics.PUBLIC_KEYS_ENV in refused.stderr

        stop = _action(run_id, "stop", keys.signing, job_id="777", host="gpu-3")  # signed params
        sentinel = _action(run_id, "alert", keys.signing)
        publish_actions(broker.bootstrap, [stop, stop, sentinel])
        proc = subprocess.Popen(
            args,
            env={**env, **keys.trainer_env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=tmp_path,
        )
        try:
            eventually(lambda: hook.for_action(sentinel.action_id), 45, "the remediate process to post")
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert _marker_lines(marker, stop.action_id) == [f"{stop.action_id} 777 gpu-3"]
        assert len(hook.for_action(stop.action_id)) == 1
        assert "remediate stopped: executions {'ok': 3}" in out
        assert "'duplicate': 1" in out
