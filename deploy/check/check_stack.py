"""The deploy check's containers (``Stack``: started, waited for, logged, all removed at the end), the
services it runs (``Services``), and what a worker says of itself over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from check_compose import PRIVATE_ENV
from check_shell import Failed, http_get, podman, say


class Stack:
    def __init__(self, work: Path) -> None:
        self.prefix = f"rwcheck-{os.getpid()}"
        self.work = work
        self.containers: list[str] = []
        self.trainers: list[subprocess.Popen[bytes]] = []
        self.steps_to_rollback: dict[str, int] = {}  # run -> steps from its NaN to the rollback applied

    def start(
        self, name: str, image: str, args: Sequence[str], env: dict[str, str], extra: Sequence[str] = ()
    ) -> str:
        full = f"{self.prefix}-{name}"
        secret = {k: v for k, v in env.items() if k in PRIVATE_ENV}  # (by name: -e NAME)
        envs = [a for k, v in env.items() for a in (("-e", k) if k in secret else ("-e", f"{k}={v}"))]
        self.containers.append(full)
        podman(
            "run", "-d", "--name", full, "--network=host",
            *envs, *extra, image, *args,
            what=f"starting {name}",
            env={**os.environ, **secret},
        )  # fmt: skip
        return full

    def status(self, name: str) -> tuple[str, int]:
        state, code = podman(
            "container", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name
        ).split()
        return state, int(code)

    def logs(self, name: str) -> str:
        proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60)
        return proc.stdout + proc.stderr

    def wait(self, name: str, ready: Callable[[], bool], timeout: float, started: float) -> float:
        """Seconds from ``started`` until ``ready()``; fails at once if the container exits first."""
        while True:
            if ready():
                return time.monotonic() - started
            state, code = self.status(name)
            if state != "running":
                self.show_log(name)
                raise Failed(f"{name} {state} (exit {code}) before it was ready: {self.last_line(name)}")
            if time.monotonic() - started > timeout:
                self.show_log(name)
                raise Failed(f"{name} not ready within {timeout:.0f} s: {self.last_line(name)}")
            time.sleep(0.2)

    def last_line(self, name: str) -> str:
        lines = [line for line in self.logs(name).splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def show_log(self, name: str) -> None:
        print(f"--- last lines of {name}:", file=sys.stderr)
        print("\n".join(self.logs(name).splitlines()[-25:]), file=sys.stderr)

    def uid(self, name: str) -> int:
        return int(podman("exec", name, "id", "-u", what=f"id -u in {name}").strip())

    def remove_all(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave containers behind
            signal.signal(sig, signal.SIG_IGN)
        for trainer in self.trainers:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        if self.containers:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *reversed(self.containers)], capture_output=True)
            left = subprocess.run(
                ["podman", "ps", "-a", "-q", "--filter", f"name=^{self.prefix}-"],
                capture_output=True,
                text=True,
            ).stdout.split()
            say(f"removed {len(self.containers)} container(s)" + (f"; {len(left)} left!" if left else ""))
            self.containers = []


class Services(NamedTuple):
    bootstrap: str
    partitions: int
    workers: dict[str, int]  # container -> web port


def readyz(port: int) -> Callable[[], bool]:
    return lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200


def telemetry_partitions(port: int) -> set[int]:
    _, health = http_get(f"http://127.0.0.1:{port}/health")
    names = (health or {}).get("partitions") or []
    return {int(p.rsplit(":", 1)[1]) for p in names if p.startswith("runwatch.telemetry:")}
