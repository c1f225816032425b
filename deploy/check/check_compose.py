"""compose.yaml as the deploy check reads it (each service's command, mounts, environment and options),
and the secrets the check's services get: the workers' state key and signing key, per check."""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any

import yaml
from check_shell import DEPLOY, Failed

from runwatch.contract.signing import ActionSigningKey
from runwatch.contract.topics import PUBLIC_KEYS_ENV, SIGNING_KEY_ENV

STATE_SECRET = secrets.token_hex(32)  # the workers' state key (RUNWATCH_STATE_SECRET): never the trainers'
# The workers' action signing key: only the worker containers get it (by name, off the command line); the
# sink, the remediator and the trainers get its public key, which cannot sign (docs/security.md). On one line,
# as deploy/.env holds it.
SIGNING_KEY = ActionSigningKey.generate()
PRIVATE_ENV = ("RUNWATCH_STATE_SECRET", SIGNING_KEY_ENV)  # passed to podman by name (-e NAME)

# Where a ClickHouse server's DSN in compose becomes an embedded store inside the container (stand-ins image).
EMBEDDED_DSN = {
    "sink": {"RUNWATCH_CLICKHOUSE_DSN": "chdb:///var/lib/runwatch/store"},
    "remediator": {"RUNWATCH_REMEDIATE_DSN": "chdb:///var/lib/runwatch/remediate"},
}

_INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR}`` and ``${VAR:-default}`` (from this environment); no ``${VAR:?}`` is expected."""
    if "${" in _INTERPOLATION.sub("", value):
        raise Failed(f"compose.yaml: cannot interpolate {value!r} here")
    return _INTERPOLATION.sub(lambda m: os.environ.get(m.group(1)) or m.group(2) or "", value)


class Compose:
    def __init__(self, path: Path = DEPLOY / "compose.yaml") -> None:
        self.path = path
        self.services: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["services"]

    def command(self, service: str) -> list[str]:
        return [interpolate(str(arg)) for arg in self.services[service]["command"]]

    def mounts(self, service: str) -> list[str]:
        """``-v`` arguments for the service's bind mounts (paths relative to compose.yaml's folder)."""
        out = []
        for volume in self.services[service].get("volumes", []):
            host, container, *mode = str(volume).split(":")
            if host.startswith("."):
                out += ["-v", ":".join([str((self.path.parent / host).resolve()), container, *mode])]
        return out

    def env(self, service: str, bootstrap: str) -> dict[str, str]:
        """The service's environment with this machine in place of the deployment's servers: the broker for
        Kafka, an embedded store for the ClickHouse server the service writes to; the other ClickHouse
        DSNs are left out (the workers' baselines: no server here, and the runwatch image holds no chdb)."""
        kafka = self.option("topics", "--bootstrap")  # compose's Kafka address
        out = {}
        for key, value in (self.services[service].get("environment") or {}).items():
            if key == PUBLIC_KEYS_ENV:
                out[key] = SIGNING_KEY.public.text
                continue
            if key == SIGNING_KEY_ENV:
                # the workers' alone: not in this process's environment, which the trainers inherit
                out[key] = " ".join(SIGNING_KEY.pem().decode().split())  # (Stack.start: off the command line)
                continue
            if key == "RUNWATCH_STATE_SECRET":
                # the workers' alone: not in this process's environment, which the trainers inherit
                out[key] = STATE_SECRET  # (Stack.start keeps it off the command line)
                continue
            value = str(value)
            if re.match(r"https?://.*:8123$", value):  # a ClickHouse server
                if key in EMBEDDED_DSN.get(service, {}):
                    out[key] = EMBEDDED_DSN[service][key]
                continue
            out[key] = interpolate(value.replace(kafka, bootstrap))
        return out

    def option(self, service: str, name: str) -> str:
        command = self.command(service)
        return command[command.index(name) + 1]
