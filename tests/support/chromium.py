"""Headless Chromium driven over the Chrome DevTools protocol (websocket-client): open a page, collect
every console error and uncaught exception, evaluate JavaScript, take a full-page screenshot.

Debian's ``chromium`` is found on PATH (``chromium``, ``chromium-browser``, ``google-chrome``) or, when
we are root and apt-get exists, installed (as ``make clients`` does); ``find_chromium`` says why not
otherwise.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(install: bool = True) -> tuple[str | None, str]:
    """(path, "") of a Chromium, installing Debian's when root; else (None, why not)."""
    for name in NAMES:
        if path := shutil.which(name):
            return path, ""
    if not install:
        return None, "no chromium on PATH"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return (
            None,
            "no chromium on PATH, and not root with apt-get to install it (Debian: apt-get install chromium)",
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            return None, f"apt-get could not install chromium: {proc.stderr.strip()[-500:]}"
    path = shutil.which("chromium")
    return (path, "") if path else (None, "apt-get installed chromium but it is not on PATH")


class Browser:
    """One headless Chromium with one page; use as a context manager (the process is ended by pid)."""

    def __init__(self, binary: str, width: int = 1500, height: int = 1000):
        self.binary, self.width, self.height = binary, width, height
        self.profile = tempfile.mkdtemp(prefix="runwatch-chromium-")
        self.console_errors: list[str] = []
        self._ids = itertools.count(1)

    def __enter__(self) -> Browser:
        import websocket

        argv = [
            self.binary,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            f"--window-size={self.width},{self.height}",
            "about:blank",
        ]
        # Its own process group: the renderer and crashpad children write to the profile too, so all of them
        # are ended before the profile is removed.
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        port = self._devtools_port(timeout=60)
        pages = self._page_targets(port, timeout=30)
        self.ws = websocket.create_connection(
            pages[0]["webSocketDebuggerUrl"], timeout=30, suppress_origin=True
        )
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.call(method)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        self._end_group(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self._end_group(signal.SIGKILL)
            self.proc.wait(10)
        self._end_group(signal.SIGKILL)  # children that outlived the browser process
        self._remove_profile(timeout=10)

    def _end_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _remove_profile(self, timeout: float) -> None:
        # A child killed a moment ago may still flush a file into the profile: try again until it is gone.
        deadline = time.monotonic() + timeout
        while True:
            try:
                shutil.rmtree(self.profile)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _devtools_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        assert self.proc.stderr is not None
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(m.group(1))
        raise RuntimeError("chromium did not open its DevTools port: " + "".join(seen)[-2000:])

    @staticmethod
    def _page_targets(port: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as response:
                pages = [t for t in json.load(response) if t.get("type") == "page"]
            if pages:
                return pages
            time.sleep(0.2)
        raise RuntimeError("chromium has no page target")

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(
                "console."
                + params["type"]
                + ": "
                + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            )
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console_errors.append(
                "uncaught: " + str(details.get("exception", {}).get("description") or details.get("text"))
            )
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self.console_errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events seen meanwhile are recorded)."""
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._on_event(message)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str, until: str, timeout: float = 60) -> Any:
        """Navigate to ``url`` and wait until the JavaScript ``until`` is truthy; returns its value."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=self.height,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(until)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(
            f"{until} not true within {timeout}s on {url}; console errors: {self.console_errors}"
        )

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the page (its whole height when ``full_page``)."""
        if full_page:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            self.call(
                "Emulation.setDeviceMetricsOverride",
                width=self.width,
                height=height,
                deviceScaleFactor=1,
                mobile=False,
            )
            time.sleep(0.5)  # plotly's responsive relayout
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path
