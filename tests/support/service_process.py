"""A runwatch command started as a deployment starts it: its own process, as a non-root user (the image's
uid when the tests run as root), in an empty working directory with an empty HOME and only the environment
it is given (nothing of the test's). Readiness is what its supervisor would see: the ready file
(``RUNWATCH_READY_FILE``, written once the consumer group has given it partitions) and, where the manifest
declares one, its HTTP readiness endpoint. Stopped by process group.

Where the interpreter sits in a folder other users cannot enter (pyenv under /root, mode 700), the process
gets its own mount namespace in which that folder shows only what it needs (a container's view of an image
that installed Python for everyone): nothing on the machine changes, and the user is still not root."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

ENTRYPOINT = Path(sys.executable).with_name("runwatch")  # the console script, as the image's ENTRYPOINT
IMAGE_USER = 10001  # the Dockerfile's uid, the manifests' runAsUser


class ServiceFailed(AssertionError):
    """A service exited, or did not become ready in time: says which command line, and its log's tail."""


REPO = Path(__file__).resolve().parents[2]


def as_root() -> bool:
    return os.geteuid() == 0


def port_free(port: int) -> bool:
    """Whether ``port`` on the loopback can be listened on now (a documented fixed port may be taken)."""
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def closed_folders(paths: Sequence[Path]) -> dict[Path, set[str]]:
    """Folders on the way to ``paths`` that other users cannot traverse, each with the entries the paths
    need in it."""
    out: dict[Path, set[str]] = {}
    for path in paths:
        path = path.resolve()
        for folder in reversed(path.parents):
            if folder != Path("/") and not folder.stat().st_mode & stat.S_IXOTH:
                out.setdefault(folder, set()).add(path.relative_to(folder).parts[0])
                break
    return out


def _as_user(argv: list[str], uid: int, views: Path) -> list[str]:
    """``argv`` run as ``uid``; in a mount namespace that opens the closed folders the interpreter, the
    environment and the checkout are in (each shows only the entries they need)."""
    needed = [Path(sys.executable), Path(sys.prefix), Path(sys.base_prefix), REPO]
    script = []
    for i, (folder, entries) in enumerate(sorted(closed_folders(needed).items())):
        view = views / f"view-{i}"
        view.mkdir(mode=0o755)
        for entry in sorted(entries):
            original = folder / entry
            (view / entry).mkdir() if original.is_dir() else (view / entry).touch()
            script.append(f"mount --bind {shlex.quote(str(original))} {shlex.quote(str(view / entry))}")
        script.append(f"mount --rbind {shlex.quote(str(view))} {shlex.quote(str(folder))}")
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", *argv]
    if not script:
        return drop
    script.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(script), "sh", *drop]


class Sandbox:
    """A folder of folders owned by the services' user, under /tmp so that user can reach them (pytest's
    tmp_path is root's, mode 700). Removed by ``cleanup``."""

    def __init__(self, user: int = IMAGE_USER):
        self.user = user if as_root() else os.geteuid()
        self.root = Path(tempfile.mkdtemp(prefix="runwatch-deploy-"))
        self.root.chmod(0o755)

    def folder(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        for p in [path, *path.parents]:
            if p == self.root:
                break
            if as_root():
                os.chown(p, self.user, self.user)
        return path

    def cleanup(self) -> None:
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


class ServiceProcess:
    """``runwatch ARGS`` (or another ``argv``) in an empty folder of ``sandbox``; its output in ``log``."""

    def __init__(
        self,
        label: str,
        args: Sequence[str],
        env: Mapping[str, str],
        sandbox: Sandbox,
        *,
        user: int | None = None,
        web_port: int | None = None,
        ready_path: str | None = None,
        argv: Sequence[str] | None = None,
        shown: str | None = None,
    ):
        self.label = label
        self.argv = list(argv) if argv is not None else [str(ENTRYPOINT), *args]
        # (``shown``: the command line as its manifest has it, before localize())
        self.command_line = shown or shlex.join(["runwatch", *args] if argv is None else self.argv)
        self.cwd = sandbox.folder(label, "work")
        self.home = sandbox.folder(label, "home")
        self.ready_file = sandbox.folder(label, "run") / "ready"
        self.log_path = sandbox.root / f"{label}.log"
        self.web_port, self.ready_path = web_port, ready_path
        full_env = {
            "PATH": f"{ENTRYPOINT.parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "RUNWATCH_READY_FILE": str(self.ready_file),
            **env,
        }
        run = self.argv
        if as_root():
            uid = user if user is not None else sandbox.user
            run = _as_user(self.argv, uid, sandbox.folder(label, "views"))
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                run, cwd=self.cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def _failed(self, what: str) -> ServiceFailed:
        return ServiceFailed(f"{self.label}: `{self.command_line}` {what}; its log ends:\n{self.log()}")

    def wait_exit(self, timeout: float, expect: int = 0) -> None:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise self._failed(f"did not finish within {timeout:.0f} s") from None
        if code != expect:
            raise self._failed(f"exited {code}")

    def http(self, path: str, timeout: float = 2.0) -> tuple[int, dict]:
        try:
            url = f"http://127.0.0.1:{self.web_port}{path}"
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, {}

    def is_ready(self) -> bool:
        if self.process.poll() is not None:
            raise self._failed(f"exited {self.process.returncode} before it was ready")
        if not self.ready_file.exists():
            return False
        if self.ready_path is None:
            return True
        try:
            return self.http(self.ready_path)[0] == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float) -> float:
        """Seconds it took to become ready."""
        started = time.monotonic()
        while not self.is_ready():
            if time.monotonic() - started > timeout:
                self.stop()
                raise self._failed(f"was not ready within {timeout:.0f} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM to the service alone, as a supervisor stops a container's first process (its children are
        its own to stop); then SIGKILL to whatever of its group is left. Its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.process.wait(10)
