"""``runwatch launch``: a small supervisor for what a process cannot say about itself (issue 39).

It starts the command as its child with the same environment (plus ``RUNWATCH_CRASH_DIR``, a folder of its
own, and ``RUNWATCH_RUN_ID``), relays the signals a scheduler sends (SIGTERM, SIGINT, SIGHUP, SIGUSR1,
SIGUSR2) to it, copies its stdout and stderr through while keeping a bounded tail, and when the child dies by
a signal or with a non-zero exit code without having said so itself (no ``reported`` file, no closed run in
its crash folder), publishes a ``crash`` event with source ``launcher``: the exit code or the signal, the
faulthandler text of a fatal signal, the kernel's OOM kill where the cgroup counts one, and the output's
tail. The event's ``ts`` is when the child died. It exits as the child did (128 + the
signal for a signal). Nothing of the child's output is run or parsed beyond being text.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from runwatch.contract import groups, topics
from runwatch.contract.schema import CrashEvent, bound_crash
from runwatch.producer.publish.crash_capture import (
    CLOSED_FILE,
    CRASH_DIR_ENV,
    FAULTHANDLER_FILE,
    REPORTED_FILE,
    host_name,
)
from runwatch.producer.publish.events import RunEvents

log = logging.getLogger(__name__)

RUN_ID_ENV = "RUNWATCH_RUN_ID"
RELAYED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
TAIL_BYTES = 12 * 1024  # of the child's output, kept for its crash event
FAULT_BYTES = 4 * 1024  # of its faulthandler file
PUBLISH_TIMEOUT_S = 5.0


class OutputTail:
    """The last ``limit`` bytes of what went through, thread-safe."""

    def __init__(self, limit: int = TAIL_BYTES):
        self.limit = limit
        self._chunks: deque[bytes] = deque()
        self._size = 0
        self._lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        with self._lock:
            self._chunks.append(chunk)
            self._size += len(chunk)
            while self._size - len(self._chunks[0]) >= self.limit and len(self._chunks) > 1:
                self._size -= len(self._chunks.popleft())

    def text(self) -> str:
        with self._lock:
            data = b"".join(self._chunks)
        return data[-self.limit :].decode(errors="replace")


def _tee(source: IO[bytes], sink: IO[bytes], tail: OutputTail) -> None:
    for chunk in iter(lambda: source.read1(65536), b""):  # type: ignore[attr-defined]
        tail.add(chunk)
        try:
            sink.write(chunk)
            sink.flush()
        except (OSError, ValueError):
            pass


def _oom_kills() -> int | None:
    """The kernel's OOM kills counted in this process's cgroup (v2 ``memory.events``), None if unreadable."""
    try:
        line = Path("/proc/self/cgroup").read_text().strip().splitlines()[0]
        path = Path("/sys/fs/cgroup") / line.split("::", 1)[1].lstrip("/") / "memory.events"
        for row in path.read_text().splitlines():
            name, _, value = row.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, IndexError, ValueError):
        return None
    return None


def _closed_status(crash_dir: Path) -> str | None:
    try:
        return (crash_dir / CLOSED_FILE).read_text().strip()
    except OSError:
        return None


def death_facts(returncode: int, relayed_term: bool) -> dict[str, Any]:
    """``signal`` / ``exit_code`` of a child's end: a negative return code is a signal; a scheduler's
    SIGTERM relayed to a child that then exited any way is a SIGTERM (preemption)."""
    if returncode < 0:
        return {"signal": -returncode}
    if relayed_term:
        return {"signal": int(signal.SIGTERM), "exit_code": returncode}
    return {"exit_code": returncode}


def launcher_text(tail: str, fault: str | None, oom: str | None) -> str:
    parts = [tail.rstrip("\n")] if tail else []
    if fault:
        parts.append("--- faulthandler ---\n" + fault[-FAULT_BYTES:].rstrip("\n"))
    if oom:
        parts.append(oom)
    return "\n".join(parts) + "\n" if parts else ""


class Launcher:
    """Runs ``command`` as a watched child of ``run_id``'s ``rank`` (``run``: its exit status)."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        run_id: str,
        rank: int,
        world_size: int = 1,
        bootstrap: str | None = None,
        host: str | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.command = list(command)
        self.run_id, self.rank, self.world_size = run_id, rank, world_size
        self.bootstrap = bootstrap or topics.bootstrap_from_env("127.0.0.1:9092")
        self.host = host or host_name()
        self.env = dict(os.environ if env is None else env)
        self.relayed_term = False
        self.child: subprocess.Popen[bytes] | None = None
        self.died_at: datetime | None = None
        self.published: CrashEvent | None = None

    def _relay(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM:
            self.relayed_term = True
        child = self.child
        if child is not None and child.poll() is None:
            try:
                child.send_signal(signum)
            except OSError:
                pass

    def run(self) -> int:
        crash_dir = Path(tempfile.mkdtemp(prefix="runwatch-crash-"))
        env = {**self.env, CRASH_DIR_ENV: str(crash_dir), RUN_ID_ENV: self.run_id}
        previous = {sig: signal.getsignal(sig) for sig in RELAYED_SIGNALS}
        tail = OutputTail()
        oom_before = _oom_kills()
        try:
            for sig in RELAYED_SIGNALS:
                signal.signal(sig, self._relay)
            self.child = child = subprocess.Popen(
                self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            threads = [
                threading.Thread(target=_tee, args=(child.stdout, sys.stdout.buffer, tail), daemon=True),
                threading.Thread(target=_tee, args=(child.stderr, sys.stderr.buffer, tail), daemon=True),
            ]
            for t in threads:
                t.start()
            returncode = child.wait()
            self.died_at = datetime.now(UTC)
            for t in threads:
                t.join(2.0)
            self._after(returncode, crash_dir, tail, oom_before)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            shutil.rmtree(crash_dir, ignore_errors=True)
        return 128 - returncode if returncode < 0 else returncode

    def _after(self, returncode: int, crash_dir: Path, tail: OutputTail, oom_before: int | None) -> None:
        said = (crash_dir / REPORTED_FILE).exists() or _closed_status(crash_dir) == "stopped"
        print(
            f"runwatch launch: {self.command[0]} (rank {self.rank}) ended with "
            f"{'signal ' + str(-returncode) if returncode < 0 else 'exit code ' + str(returncode)} at "
            f"{self.died_at.isoformat() if self.died_at else '?'}"
            f"{'; it reported its crash itself' if said else ''}",
            file=sys.stderr,
            flush=True,
        )
        if said or (returncode == 0 and not self.relayed_term):
            return
        fault = None
        try:
            fault = (crash_dir / FAULTHANDLER_FILE).read_text(errors="replace") or None
        except OSError:
            pass
        oom_after = _oom_kills()
        oom = None
        if oom_before is not None and oom_after is not None and oom_after > oom_before:
            oom = (
                f"Out of memory: the kernel's OOM killer killed a process of this job's cgroup "
                f"(memory.events oom_kill {oom_before} -> {oom_after})"
            )
        self.publish(returncode, launcher_text(tail.text(), fault, oom))

    def publish(self, returncode: int, text: str) -> bool:
        from runwatch.producer.publish.kafka_delivery import KafkaDelivery

        split = None
        group_size = int(os.environ.get(topics.GROUP_SIZE_ENV, groups.DEFAULT_GROUP_SIZE) or 0) or None
        if group_size and groups.is_split(self.world_size, group_size):
            split = (group_size, self.world_size)
        events = RunEvents(self.run_id, self.rank, None, split)
        died_at = self.died_at or datetime.now(UTC)
        event = bound_crash(
            events.build(
                CrashEvent,
                ts=died_at,
                source="launcher",
                host=self.host,
                log_tail=text or None,
                **death_facts(returncode, self.relayed_term),
            )
        )
        delivery = KafkaDelivery(
            self.run_id,
            self.rank,
            self.bootstrap,
            key=groups.record_key(self.run_id, self.rank, split[0] if split else None),
            spool_path=None,
        )
        ok = delivery.deliver(event)
        delivery.close(PUBLISH_TIMEOUT_S)
        self.published = event
        return ok and delivery.stats.published >= 1
