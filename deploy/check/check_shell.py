"""The deploy check's ground: where the repository is, the timeouts, one-line failures (``Failed``), timed
log lines, commands (``run``, ``podman``) whose failure says its last line, and a JSON GET."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHECK = DEPLOY / "check"

TIMEOUT = {"broker": 90, "worker": 180, "service": 180, "train": 240, "takeover": 120}

T0 = time.monotonic()


class Failed(Exception):
    """What went wrong, in one line."""


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", flush=True)


def run(
    cmd: Sequence[str],
    *,
    timeout: float = 120,
    log: Path | None = None,
    what: str = "",
    env: dict[str, str] | None = None,
) -> str:
    """Run ``cmd``: its output is returned (or appended to ``log``); a failure raises Failed (last line)."""
    try:
        if log is not None:
            with log.open("ab") as out:
                proc = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, text=True, env=env
                )
            text = ""
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            text = proc.stdout
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    except subprocess.TimeoutExpired:
        raise Failed(f"{what or cmd[0]} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        if tail:
            print("\n".join(tail), file=sys.stderr)
        last = tail[-1] if tail else ""
        raise Failed(f"{what or ' '.join(cmd[:3])} failed (exit {proc.returncode}): {last}")
    return text


def podman(
    *args: str,
    timeout: float = 120,
    log: Path | None = None,
    what: str = "",
    env: dict[str, str] | None = None,
) -> str:
    return run(["podman", *args], timeout=timeout, log=log, what=what or f"podman {args[0]}", env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str) -> tuple[int, dict[str, Any] | None]:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None
