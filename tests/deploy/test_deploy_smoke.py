"""What deploy/ runs, started for real (issue 34): every runwatch service of deploy/compose.yaml and of the
Kubernetes base, read from those files (not a copy), each as its own process, as the image's non-root user,
from an empty working directory with an empty HOME, against an embedded broker and embedded ClickHouse
stores standing in for the servers (deploy_manifests.py says what is changed and why). Each must become
ready, and a real training run with a NaN streak must get its rollback through them. A manifest changed to
a command line that cannot start fails the smoke test (the test of the test), and `runwatch worker` as the
issue's user ran it, from an empty directory, becomes ready."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from runwatch.worker.state.snapshot import STATE_SECRET_ENV
from tests.support.action_keys import ActionKeys
from tests.support.deploy_manifests import (
    DEPLOY,
    Service,
    StandIns,
    compose_services,
    k8s_services,
    kustomize,
    localize,
)
from tests.support.service_process import (
    Sandbox,
    ServiceFailed,
    ServiceProcess,
    port_free,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

TRAINER = Path(__file__).parents[1] / "support" / "fault_train.py"
READY_TIMEOUT_S = (
    120  # on two busy cores a worker's start (Faust, the detector process, a group join) is ~15 s
)
# What compose.yaml requires of deploy/.env (deploy/.env.example names them).
COMPOSE_ENV = {
    "RUNWATCH_CLICKHOUSE_PASSWORD": "smoke-test",
    "RUNWATCH_CLICKHOUSE_READER_PASSWORD": "smoke-test-reader",
    "GRAFANA_ADMIN_PASSWORD": "smoke-test-admin",
}


def _create_kafka_topics(bootstrap: str, docs: list[dict]) -> list[str]:
    """What Strimzi's Topic Operator does with the base's KafkaTopics (one broker here: one replica)."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    wanted = [d["spec"] for d in docs if d["kind"] == "KafkaTopic"]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        admin.create_topics(
            [
                NewTopic(
                    s["topicName"],
                    s["partitions"],
                    1,
                    topic_configs={k: str(v) for k, v in (s.get("config") or {}).items()},
                )
                for s in wanted
            ]
        )
    finally:
        admin.close()
    return [s["topicName"] for s in wanted]


class Stack:
    """The services of one manifest set, started in their order on this machine's stand-ins."""

    def __init__(self, services: list[Service], bootstrap: str, sandbox: Sandbox, keys: ActionKeys):
        self.sandbox = sandbox
        self.stores = sandbox.folder("stores")
        self.stand_ins = StandIns(
            bootstrap=bootstrap,
            store=self._store,
            signing_key=keys.pem,
            public_keys=keys.public_text,
            state_secret=secrets.token_hex(32),
            free_port=free_port,
        )
        self.services = services
        # the deployment's Kafka address, as its services are given it
        self.kafka_address = next(
            s.env[topics.BOOTSTRAP_ENV] for s in services if topics.BOOTSTRAP_ENV in s.env
        )
        self.running: dict[str, ServiceProcess] = {}
        self.ready_s: dict[str, float] = {}

    def _store(self, service: Service, variable: str) -> str:
        # One ClickHouse server behind every DSN in the deployment; one process per embedded path here. The
        # sink's store is the one `migrate` prepared before it (compose's one-shot, k8s's init container).
        name = "clickhouse" if variable == "RUNWATCH_CLICKHOUSE_DSN" else f"{service.name}-{variable.lower()}"
        return f"chdb://{self.stores / name}"

    def process(self, service: Service) -> ServiceProcess:
        local, web_port = localize(service, self.kafka_address, self.stand_ins)
        label = f"{service.source}-{service.name}"
        return ServiceProcess(
            label,
            local.args,
            local.env,
            self.sandbox,
            user=service.user,
            web_port=web_port,
            ready_path=service.ready_path or ("/readyz" if web_port else None),
            shown=service.command_line,
        )

    def start(self) -> None:
        """One-shots run to completion in their turn; the services then start together and must get ready."""
        for service in self.services:
            if service.one_shot:
                self.process(service).wait_exit(READY_TIMEOUT_S)
        for service in self.services:
            if not service.one_shot:
                self.running[service.name] = self.process(service)
        for name, proc in self.running.items():
            self.ready_s[name] = proc.wait_ready(READY_TIMEOUT_S)

    def stop(self) -> dict[str, int | None]:
        return {name: proc.stop() for name, proc in self.running.items()}


def _nan_run(bootstrap: str, public_keys: str, folder: Path) -> dict:
    """A real training run (fault_train.py) whose batch of step 50 holds a NaN; checkpoints every 10 steps."""
    folder.mkdir(parents=True)
    run_id = f"deploy-nan-{uuid.uuid4().hex[:8]}"
    # a trainer holds the workers' public key, nothing that signs
    env = {**os.environ, topics.PUBLIC_KEYS_ENV: public_keys, "RUNWATCH_SPOOL_DIR": str(folder / "spool")}
    done = subprocess.run(
        [sys.executable, str(TRAINER), "--bootstrap", bootstrap, "--run-id", run_id, "--out", str(folder)]
        + ["--steps", "120", "--fault", "nan:50", "--checkpoint-every", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {"run_id": run_id, **json.loads((folder / "result.json").read_text())}


@pytest.fixture
def bare_broker(tmp_path) -> Iterator[EmbeddedBroker]:
    """A broker with no topics: the manifests' own step creates them."""
    with EmbeddedBroker(log_path=tmp_path / "broker.log") as broker:
        yield broker


def _manifest_services(source: str, config_root: Path) -> tuple[list[Service], list[dict]]:
    if source == "compose":
        filled = {
            topics.SIGNING_KEY_ENV: "from-deploy-env",
            topics.PUBLIC_KEYS_ENV: "from-deploy-env",
            STATE_SECRET_ENV: "from-deploy-env",
        }
        return compose_services(COMPOSE_ENV | filled), []
    docs = kustomize()
    return k8s_services(docs, config_root), docs


@pytest.mark.parametrize("source", ["compose", "k8s"])
def test_every_runwatch_service_of_the_manifests_starts_and_rolls_back_a_nan_run(
    source, bare_broker, sandbox, tmp_path
):
    services, docs = _manifest_services(source, sandbox.folder("config"))
    names = {s.name for s in services}
    # every runwatch service the manifests declare is here (a service added to them is run too)
    expected = {"topics", "migrate", "worker", "sink", "remediator"} - (
        {"topics"} if source == "k8s" else set()
    )
    assert names == expected, names
    # the workers' state key reaches the workers and nothing else (docs/state.md)
    assert {s.name for s in services if STATE_SECRET_ENV in s.env} == {"worker"}
    # the action signing key reaches only the workers; the sink and the remediator verify with the public key
    # (docs/security.md)
    assert {s.name for s in services if topics.SIGNING_KEY_ENV in s.env} == {"worker"}
    assert {"worker", "sink", "remediator"} <= {s.name for s in services if topics.PUBLIC_KEYS_ENV in s.env}
    if source == "k8s":
        assert set(_create_kafka_topics(bare_broker.bootstrap, docs)) >= set(topics.CREATED_TOPICS)
    keys = ActionKeys.generate()
    stack = Stack(services, bare_broker.bootstrap, sandbox, keys)
    try:
        stack.start()
        result = _nan_run(bare_broker.bootstrap, keys.public_text, tmp_path / "train")
    finally:
        codes = stack.stop()
    kinds = [(a["kind"], a["outcome"]) for a in result["applied"]]
    assert ("rollback", "applied") in kinds, (result["applied"], stack.running["worker"].log())
    assert result["status"] == "completed"
    # stopped cleanly (SIGTERM: a supervisor's stop) and the sink stored the signed rollback it carried
    assert all(code == 0 for code in codes.values()), codes
    from runwatch.sinks.clickhouse import ClickHouseSink

    store = ClickHouseSink(f"chdb://{stack.stores / 'clickhouse'}")
    try:
        stored = store.query(
            "SELECT kind FROM {db}.actions WHERE run_id = {{run:String}}", {"run": result["run_id"]}
        )
    finally:
        store.close()
    assert ("rollback",) in stored, stored
    print(json.dumps({"source": source, "ready_s": {k: round(v, 1) for k, v in stack.ready_s.items()}}))


def _unstartable_compose(tmp_path: Path) -> Path:
    """compose.yaml with the worker's --config pointed at a file the mounted folder does not hold."""
    folder = tmp_path / "deploy"
    folder.mkdir()
    (folder / "config").symlink_to(DEPLOY / "config")
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    command = doc["services"]["worker"]["command"]
    command[command.index("--config") + 1] = "/etc/runwatch/runwatch.yml"  # a typo
    path = folder / "compose.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_smoke_test_fails_on_a_manifest_command_line_that_cannot_start(broker, sandbox, tmp_path):
    keys = ActionKeys.generate()
    env = COMPOSE_ENV | {**keys.worker_env, **keys.trainer_env, STATE_SECRET_ENV: secrets.token_hex(32)}
    worker = next(s for s in compose_services(env, _unstartable_compose(tmp_path)) if s.name == "worker")
    stack = Stack([worker], broker.bootstrap, sandbox, keys)
    with pytest.raises(ServiceFailed, match=r"runwatch worker --config /etc/runwatch/runwatch.yml.*exited 2"):
        stack.start()
    # and a Kubernetes container whose args lost a value: refused by the command line, not hung
    docs = kustomize()
    for d in docs:
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "runwatch-remediator":
            d["spec"]["template"]["spec"]["containers"][0]["args"] = ["remediate", "--config"]
    remediator = next(s for s in k8s_services(docs, sandbox.folder("config")) if s.name == "remediator")
    with pytest.raises(ServiceFailed, match=r"runwatch remediate --config.*exited 2"):
        Stack([remediator], broker.bootstrap, sandbox, keys).start()


def test_runwatch_worker_from_an_empty_directory_becomes_ready(bare_broker, sandbox):
    """The issue's command line, runwatch worker --bootstrap HOST:PORT, with the keys issue 35 gave the
    workers: their action signing key (RUNWATCH_ACTION_SIGNING_KEY, once the shared RUNWATCH_ACTION_SECRET)
    and their own state key (RUNWATCH_STATE_SECRET). On a broker of its own: in the session broker's default
    group it would take partitions from the session worker (a rebalance in the middle of other tests)."""
    ensure_topics(bare_broker.bootstrap)
    args = ["worker", "--bootstrap", bare_broker.bootstrap]
    port = 6066
    if not port_free(port):  # (the default; another process on this machine may hold it)
        port = free_port()
        args += ["--web-port", str(port)]
    worker = ServiceProcess(
        "worker-empty-dir",
        args,
        {**ActionKeys.generate().worker_env, STATE_SECRET_ENV: secrets.token_hex(32)},
        sandbox,
        web_port=port,
        ready_path="/readyz",
    )
    try:
        worker.wait_ready(READY_TIMEOUT_S)
        assert (worker.cwd / ".runwatch" / "worker").is_dir()  # Faust's files, where it said
        assert f"Faust's files in {worker.cwd / '.runwatch' / 'worker'}" in worker.log()
    finally:
        assert worker.stop() == 0, worker.log()
