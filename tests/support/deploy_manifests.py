"""The runwatch services as deploy/ declares them, read from the files themselves (deploy/compose.yaml and
the Kubernetes base as `kubectl kustomize` builds it), and made runnable on this machine the way a container
would run them: the same arguments after the image's entrypoint (`runwatch`), the same environment, the
config files where the manifests mount them. Only what names another machine is changed (``localize``):
the Kafka bootstrap becomes the test's broker, a ClickHouse server's DSN an embedded store, a mounted path
the folder it comes from, and a fixed health port a free one (each container has its own network
namespace; these processes share the host's)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
_INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?:(:?[-?])([^}]*))?\}")


@dataclass(frozen=True)
class Service:
    """One runwatch container of a manifest: ``args`` after the image's `runwatch` entrypoint."""

    source: str  # "compose" or "k8s"
    name: str  # the compose service, or the Kubernetes container (init containers too)
    args: tuple[str, ...]
    env: Mapping[str, str]
    mounts: Mapping[str, Path] = field(default_factory=dict)  # container path -> host folder
    one_shot: bool = False  # runs to completion (compose restart "no", an init container)
    ready_path: str | None = None  # the HTTP readiness path it declares, if any
    user: int | None = None  # the uid the manifest runs it as (None: the image's)

    @property
    def command_line(self) -> str:
        return shlex.join(["runwatch", *self.args])


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?error}``; a required variable that is not
    set is an error, as `docker compose` makes it."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op in (":?", "?"):
            raise KeyError(f"{name} is required: {arg}")
        return arg if op in (":-", "-") else ""

    return _INTERPOLATION.sub(one, value)


def _interpolated(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolated(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _interpolated(v, env) for k, v in node.items()}
    return node


def compose_services(env: Mapping[str, str], path: Path = DEPLOY / "compose.yaml") -> list[Service]:
    """compose.yaml's services that run the runwatch image, in the order their ``depends_on`` starts them."""
    doc = _interpolated(yaml.safe_load(path.read_text()), env)
    services: dict[str, dict[str, Any]] = doc["services"]
    ours = {name: s for name, s in services.items() if "build" in s or "runwatch" in str(s.get("image", ""))}

    def depth(name: str) -> int:
        deps = services[name].get("depends_on") or {}
        return 1 + max((depth(d) for d in deps), default=0)

    out = []
    for name in sorted(ours, key=lambda n: (depth(n), n)):
        s = ours[name]
        mounts = {}
        for volume in s.get("volumes", []):
            host, container, *_ = volume.split(":")
            if host.startswith("."):
                mounts[container] = (path.parent / host).resolve()
        out.append(
            Service(
                source="compose",
                name=name,
                args=tuple(str(a) for a in s.get("command", [])),
                env={k: str(v) for k, v in (s.get("environment") or {}).items()},
                mounts=mounts,
                one_shot=str(s.get("restart", "")) == "no",
            )
        )
    return out


def kustomize(base: Path = DEPLOY / "k8s" / "base") -> list[dict[str, Any]]:
    """The base as `kubectl kustomize` builds it (what `kubectl apply -k` applies)."""
    kubectl = Path(sys.executable).with_name("kubectl")
    built = subprocess.run(
        [str(kubectl), "kustomize", str(base)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    return [d for d in yaml.safe_load_all(built) if d]


def k8s_services(docs: list[dict[str, Any]], config_root: Path) -> list[Service]:
    """Every runwatch container (init containers first) of the Deployments, with the environment its
    ``envFrom`` and ``env`` give it; ConfigMap volumes are written out under ``config_root``."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"}
    out = []
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        volumes = {}
        for v in pod.get("volumes", []):
            if "configMap" in v:
                folder = config_root / d["metadata"]["name"] / v["name"]
                folder.mkdir(parents=True, exist_ok=True)
                for key, text in config_maps[v["configMap"]["name"]].items():
                    (folder / key).write_text(text)
                volumes[v["name"]] = folder
        user = (pod.get("securityContext") or {}).get("runAsUser")
        containers = [(c, True) for c in pod.get("initContainers", [])]
        containers += [(c, False) for c in pod["containers"]]
        for c, init in containers:
            if not str(c["image"]).startswith("runwatch"):
                continue
            env: dict[str, str] = {}
            for source in c.get("envFrom", []):
                if "configMapRef" in source:
                    env.update(config_maps[source["configMapRef"]["name"]])
                if "secretRef" in source:
                    env.update(secrets[source["secretRef"]["name"]])
            env.update({e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e})
            mounts = {
                m["mountPath"]: volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in volumes
            }
            probe = (c.get("readinessProbe") or {}).get("httpGet") or {}
            out.append(
                Service(
                    source="k8s",
                    name=c["name"],
                    args=tuple(str(a) for a in [*c.get("command", [])[1:], *c.get("args", [])]),
                    env=env,
                    mounts=mounts,
                    one_shot=init,
                    ready_path=probe.get("path"),
                    user=(c.get("securityContext") or {}).get("runAsUser", user),
                )
            )
    return out


@dataclass(frozen=True)
class StandIns:
    """What this machine puts in place of the deployment's servers."""

    bootstrap: str  # the broker's, for the manifests' Kafka address
    store: Callable[[Service, str], str]  # (service, DSN variable) -> an embedded ClickHouse DSN
    signing_key: str  # the workers' action signing key (PEM) an operator puts in place of the placeholder
    public_keys: str  # its public key, likewise
    state_secret: str  # the workers' state key, likewise
    free_port: Callable[[], int]


def localize(service: Service, kafka_address: str, stand_ins: StandIns) -> tuple[Service, int | None]:
    """``service`` with this machine's addresses in place of the deployment's, and its health port (None
    when it serves none)."""
    web_port = None
    args = []
    it = iter(service.args)
    for arg in it:
        if arg == "--web-port":
            web_port = stand_ins.free_port()
            args += [arg, str(web_port)]
            next(it)
            continue
        if arg == "--metrics-port":  # (every service shares this host's ports: each its own)
            args += [arg, str(stand_ins.free_port())]
            next(it)
            continue
        arg = arg.replace(kafka_address, stand_ins.bootstrap)
        for container_path, host in service.mounts.items():
            if arg == container_path or arg.startswith(container_path + "/"):
                arg = str(host) + arg[len(container_path) :]
        args.append(arg)
    env = {}
    for key, value in service.env.items():
        if re.match(r"https?://[^/]*:8123", value):  # a ClickHouse server's HTTP interface
            value = stand_ins.store(service, key)
        elif key == "RUNWATCH_ACTION_SIGNING_KEY":
            value = stand_ins.signing_key  # (the k8s base ships a placeholder the worker refuses)
        elif key == "RUNWATCH_ACTION_PUBLIC_KEYS":
            value = stand_ins.public_keys  # (and one the sink and the remediator refuse)
        elif key == "RUNWATCH_STATE_SECRET":
            value = stand_ins.state_secret
        env[key] = value.replace(kafka_address, stand_ins.bootstrap)
    return replace(service, args=tuple(args), env=env), web_port
