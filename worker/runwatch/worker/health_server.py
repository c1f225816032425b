"""The worker's health endpoint as a small threaded HTTP server (the standard library's), started first
thing by ``runwatch worker``, before Faust and the detector process are even imported: it answers from
the first second. Until the worker is built it reports its startup phase (live, not ready); then it
serves ``WorkerHealth`` (worker/runwatch/worker/health.py), which says what the three paths mean.

A thread of its own, not the event loop's: a worker whose loop is blocked still answers its probes, and
the answer says so.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

log = logging.getLogger(__name__)


class Health(Protocol):
    def live(self) -> tuple[bool, str]: ...
    def ready(self) -> tuple[bool, str]: ...
    def snapshot(self) -> dict[str, Any]: ...


class Starting:
    """What the endpoint says before the worker is built: live (a supervisor must not kill a worker that
    is starting), not ready, and which step of the start it is in."""

    def __init__(self) -> None:
        self.phase = "reading its configuration"
        self.started = time.monotonic()

    def live(self) -> tuple[bool, str]:
        return True, f"starting: {self.phase}"

    def ready(self) -> tuple[bool, str]:
        return False, f"starting: {self.phase}"

    def snapshot(self) -> dict[str, Any]:
        return {
            "live": True,
            "ready": False,
            "reason": f"starting: {self.phase}",
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 3),
        }


class HealthServer:
    """``/livez``, ``/readyz`` and ``/health`` on ``host:port``, answered from ``self.health``."""

    def __init__(self, host: str, port: int):
        self.starting = Starting()
        self.health: Health = self.starting
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    status, body = server.answer(self.path)
                except Exception as exc:  # noqa: BLE001 - a probe gets an answer, whatever broke
                    status, body = 500, {"ok": False, "reason": f"health check failed: {exc!r}"}
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # probes are not logged
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="runwatch-health", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health endpoint on http://%s:%d/health", *self._server.server_address[:2])
        return self

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        route = path.split("?", 1)[0]
        if route in ("/livez", "/readyz"):
            ok, why = (self.health.live if route == "/livez" else self.health.ready)()
            return (200 if ok else 503), {"ok": ok, "reason": why}
        if route == "/health":
            snap = self.health.snapshot()
            return (200 if snap["live"] else 503), snap
        return 404, {"ok": False, "reason": f"no such path {route}: /livez, /readyz, /health"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
