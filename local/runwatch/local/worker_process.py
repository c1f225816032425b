"""``runwatch worker`` as a child process, for the demo and the tests, and waiting on what it starts."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from runwatch.contract import topics
from runwatch.contract.signing import ActionSigningKey
from runwatch.local.broker import free_port
from runwatch.local.children import die_with_parent as ending_with_parent
from runwatch.worker.state.snapshot import STATE_SECRET_ENV


@cache
def launcher_state_secret() -> str:
    """The state key of the workers this process starts: ``$RUNWATCH_STATE_SECRET``, else a new random
    one (the same for every worker this process starts; never derived from an action key)."""
    return os.environ.get(STATE_SECRET_ENV) or secrets.token_hex(32)


class LocalStackError(RuntimeError):
    """A local process did not come up, or something did not happen in time."""


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise LocalStackError(f"timed out after {timeout:.0f}s waiting for {what}")


class WorkerProcess:
    """``runwatch worker`` as a child process, stopped by pid."""

    def __init__(
        self,
        bootstrap: str,
        signing_key: str | ActionSigningKey,
        log_path: Path,
        config_path: Path | None = None,
        group: str | None = None,
        extra_args: tuple[str, ...] = (),
        die_with_parent: bool = False,
        state_secret: str | None = None,
    ):
        """``signing_key``: the action signing key (``$RUNWATCH_ACTION_SIGNING_KEY``: its PEM text or its
        file's path; or the key). ``state_secret``: the worker's state key (its snapshots are signed
        with it); None: ``$RUNWATCH_STATE_SECRET``, else one made once per launching process, so that the
        workers one demo or test starts in turn restore each other's runs."""
        # (the worker runs in the log's folder: every path it gets is absolute)
        log_path = Path(log_path).resolve()
        self.ready_file = log_path.with_suffix(".ready")
        self.ready_file.unlink(missing_ok=True)
        self.web_port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "runwatch.cli",
            "worker",
            "--bootstrap",
            bootstrap,
            "--web-port",
            str(self.web_port),
            "--web-host",
            "127.0.0.1",
            "--ready-file",
            str(self.ready_file),
        ]
        if config_path is not None:
            cmd += ["--config", str(Path(config_path).resolve())]
        if group is not None:
            cmd += ["--group", group]
        # (Faust's files beside the log, where they always were: "<group>-data")
        cmd += ["--data-dir", str(log_path.parent / f"{group or topics.DETECT_GROUP}-data")]
        cmd += list(extra_args)
        env = dict(
            os.environ,
            **{
                topics.SIGNING_KEY_ENV: signing_key.pem().decode()
                if isinstance(signing_key, ActionSigningKey)
                else signing_key,
                STATE_SECRET_ENV: state_secret or launcher_state_secret(),
            },
        )
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self._cmd, self._env, self._die_with_parent = cmd, env, die_with_parent
        self._port_retries = 3
        self.process = self._launch()

    def _launch(self) -> subprocess.Popen[bytes]:
        # (in the log's folder: Faust keeps a data directory, "<group>-data", in its working directory)
        return subprocess.Popen(
            self._cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
            cwd=self.log_path.parent,
            preexec_fn=ending_with_parent() if self._die_with_parent else None,
        )

    def _port_taken(self) -> bool:
        """The worker exited because its health port, free when chosen, was taken before it bound it (another
        process's connection got it meanwhile): a race of the launcher's, not the worker's failure."""
        if self.process.returncode != 2 or self._port_retries == 0:
            return False
        self._log.flush()
        tail = self.log_path.read_bytes()[-2000:].decode(errors="replace")
        return f"cannot listen on 127.0.0.1:{self.web_port}" in tail

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            if self.process.poll() is not None:
                if self._port_taken():  # another free port, and start again
                    self._port_retries -= 1
                    port_at = self._cmd.index("--web-port") + 1
                    self.web_port = free_port()
                    self._cmd[port_at] = str(self.web_port)
                    self.process = self._launch()
                    return False
                raise LocalStackError(
                    f"the worker exited with {self.process.returncode}; see {self.log_path}"
                )
            return self.ready_file.exists()

        wait_until(ready, timeout, "the worker to join its consumer group")

        def answering() -> bool:  # (the ready file can come before the health endpoint listens)
            try:
                self.health("/livez", timeout=1.0)
                return True
            except OSError:
                return False

        wait_until(answering, timeout, "the worker's health endpoint")

    def health(self, path: str = "/health", timeout: float = 2.0) -> tuple[int, dict[str, Any]]:
        """GET the worker's health endpoint: (HTTP status, JSON body)."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}{path}", timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._log.close()
        self.ready_file.unlink(missing_ok=True)
