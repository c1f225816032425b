"""Reading through a live page: what ``runwatch runs``, ``report`` and ``baseline check`` do when the
store they are pointed at is owned by a running stack."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from runwatch.sinks.page.address import page_file

TIMEOUT_S = 60.0  # a report of a long run takes seconds to build


class PageError(Exception):
    """The page answered with an error (an unknown run, a failed read): its message."""


class PageClient:
    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def _get(self, path: str, params: dict[str, str] | None = None) -> tuple[bytes, dict[str, str]]:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=TIMEOUT_S) as resp:
                return resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
            raise PageError(message) from None

    def health(self) -> dict[str, Any]:
        body, _ = self._get("/api/health")
        return dict(json.loads(body))

    def runs(self) -> list[dict[str, Any]]:
        body, _ = self._get("/api/runs")
        return list(json.loads(body)["runs"])

    def report(self, run_id: str, config_json: str | None = None) -> tuple[str, list[str]]:
        """The run's report HTML and its panel ids."""
        path = f"/runs/{urllib.parse.quote(run_id, safe='')}"
        params = {"file": "1", **({"config": config_json} if config_json else {})}  # (no self-reload)
        body, headers = self._get(path, params)
        panels = headers.get("X-Runwatch-Panels", "")
        return body.decode(), [p for p in panels.split(",") if p]

    def baseline(self, run_id: str, config_json: str) -> dict[str, Any]:
        """The run's baseline report (``BaselineReport``'s JSON)."""
        path = f"/api/runs/{urllib.parse.quote(run_id, safe='')}/baseline"
        body, _ = self._get(path, {"config": config_json})
        return dict(json.loads(body))


def find_page(dsn: str) -> PageClient | None:
    """The live page serving ``dsn``'s embedded store, if one announced itself and answers for it;
    else None (then the store is read directly)."""
    path = page_file(dsn)
    if path is None or not path.is_file():
        return None
    try:
        announced = json.loads(path.read_text())
        client = PageClient(str(announced["url"]))
        if int(announced["pid"]) != os.getpid():
            os.kill(int(announced["pid"]), 0)  # the owner is alive (a crashed stack leaves the file)
        health = client.health()
    except (OSError, ValueError, KeyError, TypeError, PageError):
        return None
    return client if health.get("dsn") == announced.get("dsn") else None
