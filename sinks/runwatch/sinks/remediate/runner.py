"""Running commands: without a shell, in their own session, stdin closed, runwatch's keys
removed from their environment, killed as a process group on timeout; and judging a verify
command's answer (its stdout must be the run id on every non-empty line)."""

from __future__ import annotations

import os
import signal
import subprocess

from runwatch.contract import topics
from runwatch.sinks.remediate.record import tail

# No key of runwatch's reaches a command: the remediator holds none that signs, but an environment shared
# with a worker (or an old deployment's shared secret) might.
_KEYS = (topics.SIGNING_KEY_ENV, topics.LEGACY_SECRET_ENV, "RUNWATCH_STATE_SECRET")


def child_env() -> dict[str, str]:
    """The remediator's environment without runwatch's keys."""
    return {k: v for k, v in os.environ.items() if k not in _KEYS}


def _spawn(argv: list[str], timeout_s: float, *, merge_stderr: bool) -> tuple[str, int | None, bytes, bytes]:
    """Run ``argv`` without a shell, its own session, stdin closed; returns (status, exit code,
    stdout, stderr). Status is ok, failed (non-zero exit or could not start: then stderr says
    why) or timeout (the whole process group killed)."""
    try:
        proc = subprocess.Popen(
            argv,
            shell=False,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            env=child_env(),
            start_new_session=True,
        )
    except OSError as exc:
        return "failed", None, b"", f"could not start {argv[0]!r}: {exc.strerror or exc}".encode()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # Its own session: kill the whole group, so a grandchild holding the pipe cannot hang us.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = b"", b""
        return "timeout", proc.returncode, out or b"", err or b""
    return ("ok" if proc.returncode == 0 else "failed"), proc.returncode, out or b"", err or b""


def run_command(argv: list[str], timeout_s: float) -> tuple[str, int | None, str]:
    """Run ``argv`` without a shell; returns (status, exit code, output tail)."""
    status, code, out, err = _spawn(argv, timeout_s, merge_stderr=True)
    if code is None and status == "failed":
        return status, code, err.decode(errors="replace")
    text = tail(out.decode(errors="replace"))
    return status, code, text + (f"\n[killed after {timeout_s}s]" if status == "timeout" else "")


def run_verify(argv: list[str], timeout_s: float) -> tuple[str, int | None, str, str]:
    """Run a verify command without a shell; returns (status, exit code, stdout, stderr tail).
    Only stdout counts as its answer: an error message on stderr that echoes the target can
    never verify it."""
    status, code, out, err = _spawn(argv, timeout_s, merge_stderr=False)
    return status, code, out.decode(errors="replace"), tail(err.decode(errors="replace"))


def verify_problem(run_id: str, status: str, code: int | None, stdout: str, stderr: str) -> str | None:
    """Why a verify command's result does not show that the target belongs to ``run_id``, or
    ``None`` if it does: it exited 0 and every non-empty line of its stdout, stripped, is the run id
    (at least one line). A substring would not do: run "x" must not match a comment "x-team:run-9"."""
    if status == "timeout":
        return "timed out"
    if status != "ok":
        detail = stderr.strip()[-300:]
        return (f"exited {code}" if code is not None else "did not start") + (f": {detail}" if detail else "")
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return f"printed nothing; expected the run id {run_id!r}"
    for line in lines:
        if line != run_id:
            return f"printed {line[:120]!r}, not the run id {run_id!r}: the target is not this run's"
    return None
