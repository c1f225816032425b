"""``PageServer``: the runs list and each run's report, served from the store while the sink writes it.

A threaded stdlib HTTP server in the store's own process (the embedded engine admits one process); the
store serialises statements (``ClickHouseSink``'s lock). Routes:

- ``/``: the runs list (``runs_page.py``), refreshed from ``/api/runs`` every 2 s;
- ``/runs/RUN_ID``: the run's report (sinks/report/), rebuilt on each request, reloading itself every
  10 s while the run is going on;
- ``/api/runs``, ``/api/runs/RUN_ID/baseline?config=JSON``, ``/api/health``: JSON for the commands.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import threading
import urllib.parse
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runwatch.sinks.page.address import page_file
from runwatch.sinks.page.runs_page import RUNS_PAGE

if TYPE_CHECKING:
    from runwatch.detectors.baselines.compare import BaselineConfig
    from runwatch.sinks.clickhouse import ClickHouseSink

log = logging.getLogger(__name__)
LIVE_RELOAD_S = 10
LIVE = ("running", "silent")


class _NotFound(Exception):
    pass


LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


class PageServer:
    """Serves ``sink`` on ``host:port`` (port 0: a free one) from a daemon thread; ``start()`` also
    announces the page beside an embedded store (``address.page_file``), ``stop()`` withdraws it."""

    def __init__(
        self,
        sink: ClickHouseSink,
        host: str = "127.0.0.1",
        port: int = 0,
        config: BaselineConfig | None = None,
    ):
        self.sink = sink
        self.config = config
        self._httpd = ThreadingHTTPServer((host, port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="runwatch-page", daemon=True)
        self._announced: Path | None = None

    def host_allowed(self, host_header: str | None) -> bool:
        """A page bound to a loopback address answers only requests addressed to a loopback name: a web
        page elsewhere cannot rebind its own name to 127.0.0.1 and read the runs (DNS rebinding). Bound
        to another address, it serves whatever name the operator gave it."""
        bound = self._httpd.server_address[0]
        if not ipaddress.ip_address(bound if isinstance(bound, str) else bytes(bound).decode()).is_loopback:
            return True
        if not host_header:
            return False
        name = urllib.parse.urlsplit(f"//{host_header}").hostname or ""
        return name in LOOPBACK_NAMES

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{port}/"

    def start(self) -> PageServer:
        self._thread.start()
        path = page_file(self.sink.dsn)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"url": self.url, "pid": os.getpid(), "dsn": self.sink.dsn}))
            tmp.replace(path)
            self._announced = path
        return self

    def stop(self) -> None:
        if self._announced is not None:
            self._announced.unlink(missing_ok=True)
            self._announced = None
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- what the routes answer --------------------------------------------------------------------

    def runs(self) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {
            "now": now.isoformat(),
            "runs": [r.model_dump(mode="json") for r in self.sink.runs.overview(now)],
        }

    def report(self, run_id: str, config_json: str | None, live: bool = True) -> tuple[str, list[str]]:
        """The run's report; ``live``: reloading itself while the run goes on (not in a written file)."""
        from runwatch.sinks.report import UnknownRun, build_report

        try:
            html, panels = build_report(self.sink, run_id, self._config(config_json))
        except UnknownRun as exc:
            raise _NotFound(str(exc)) from None
        status = next(
            (r.status for r in self.sink.runs.overview(datetime.now(UTC)) if r.run_id == run_id), None
        )
        if live and status in LIVE:  # the page follows a run that is still going on
            html = html.replace("<head>", f'<head><meta http-equiv="refresh" content="{LIVE_RELOAD_S}">', 1)
        return html, [p.id for p in panels]

    def baseline(self, run_id: str, config_json: str | None) -> dict[str, Any]:
        from runwatch.sinks.summaries import RunNotFound, baseline_report

        config = self._config(config_json)
        if config is None:
            from runwatch.detectors.baselines.compare import BaselineConfig

            config = BaselineConfig()
        try:
            report = baseline_report(self.sink, run_id, config)
        except RunNotFound:
            raise _NotFound(
                f"unknown run {run_id!r}: no summary and no telemetry in ClickHouse at {self.sink.dsn}"
            ) from None
        return dict(report.model_dump(mode="json"))

    def _config(self, config_json: str | None) -> BaselineConfig | None:
        if not config_json:
            return self.config
        from runwatch.detectors.baselines.compare import BaselineConfig

        return BaselineConfig.model_validate_json(config_json)


def _handler(page: PageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "runwatch-page"

        def do_GET(self) -> None:
            if not page.host_allowed(self.headers.get("Host")):
                self._json(403, {"error": "this page answers only at localhost or 127.0.0.1"})
                return
            url = urllib.parse.urlsplit(self.path)
            query = dict(urllib.parse.parse_qsl(url.query))
            parts = (
                [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")] if url.path != "/" else []
            )
            try:
                self._route(parts, query)
            except _NotFound as exc:
                self._json(404, {"error": str(exc)})
            except ValueError as exc:  # a bad config JSON
                self._json(400, {"error": str(exc)})
            except Exception as exc:  # noqa: BLE001 - one failed read answers 500, the page goes on
                log.warning("runwatch page: %s failed: %s: %s", url.path, type(exc).__name__, exc)
                self._json(500, {"error": f"reading {page.sink.dsn} failed: {type(exc).__name__}: {exc}"})

        def _route(self, parts: list[str], query: dict[str, str]) -> None:
            if not parts:
                self._send(200, RUNS_PAGE.encode(), "text/html; charset=utf-8")
            elif parts == ["favicon.ico"]:  # (no icon: an empty answer, not a 404 in the console)
                self._send(204, b"", "image/x-icon")
            elif parts == ["api", "health"]:
                self._json(200, {"service": "runwatch-page", "dsn": page.sink.dsn, "pid": os.getpid()})
            elif parts == ["api", "runs"]:
                self._json(200, page.runs())
            elif len(parts) == 2 and parts[0] == "runs":
                html, panels = page.report(parts[1], query.get("config"), live=query.get("file") != "1")
                self._send(
                    200, html.encode(), "text/html; charset=utf-8", {"X-Runwatch-Panels": ",".join(panels)}
                )
            elif len(parts) == 4 and parts[:2] == ["api", "runs"] and parts[3] == "baseline":
                self._json(200, page.baseline(parts[2], query.get("config")))
            else:
                raise _NotFound(f"no page at /{'/'.join(parts)}")

        def _json(self, status: int, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(
            self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("runwatch page: " + format, *args)

    return Handler
