"""`runwatch up` as a new user meets it (issue 26): one command starts the broker, the worker, the sink
and the local page; the README's example file (examples/quickstart.py) runs against it and has its NaN
rolled back; the local page in headless Chromium shows the run, live, while the stack writes;
`runwatch runs`, `report` and `baseline check` read through the page while the store is held; Ctrl-C
stops everything, and everything stored is still there afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runwatch.contract.schema import Action, utc_now
from runwatch.contract.signing import ActionPublicKeys, ActionSigningKey
from runwatch.local.broker import free_port
from tests.support.action_keys import forgeries, trainer_materials
from tests.support.chromium import Browser

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "quickstart.py"
ARTIFACTS = REPO / ".runwatch" / "test-artifacts"  # the page's screenshot is kept here
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RUNWATCH_")}
ROW = "document.querySelector('tr[data-run=\"{run}\"]')"


class Up:
    """`runwatch up` in its own session, its output collected by a thread; stopped by pid."""

    def __init__(self, cwd: Path, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runwatch.cli", "up", *args],
            cwd=cwd,
            env=CLEAN_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None, "\n".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n" + "\n".join(self.lines)
            time.sleep(0.2)

    def line(self, pattern: str) -> re.Match[str]:
        return next(m for line in self.lines if (m := re.search(pattern, line)))

    def kill(self) -> None:
        """Ctrl-C first (the stack stops its children), SIGKILL if it does not end."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def runwatch(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runwatch.cli", *args],
        cwd=cwd,
        env=CLEAN_ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def eventually(read, check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if check(value):
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout} s; last: {value!r}"
        time.sleep(0.5)


def test_up_watches_the_readme_example_and_its_page_shows_it_live(chromium, tmp_path):
    page_port = free_port()
    up = Up(tmp_path, "--page-port", str(page_port))
    try:
        up.wait_for("Ctrl-C stops everything.", timeout=300)
        page_url = up.line(r"page\s+(http://\S+)").group(1)
        assert page_url == f"http://127.0.0.1:{page_port}/"
        bootstrap = up.line(r"export RUNWATCH_BOOTSTRAP=(\S+)").group(1)
        key_file = tmp_path / ".runwatch" / "action-signing-key.pem"  # the worker's private key
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600  # made for the user, readable by them only
        env_text = (tmp_path / ".runwatch" / "env").read_text()
        assert env_text.startswith(f"export RUNWATCH_BOOTSTRAP={bootstrap}\n")
        public = up.line(r"export RUNWATCH_ACTION_PUBLIC_KEYS=(\S+)").group(1)  # printed and in the file
        assert f"export RUNWATCH_ACTION_PUBLIC_KEYS={public}\n" in env_text
        trainer_env = {**CLEAN_ENV, "RUNWATCH_BOOTSTRAP": bootstrap, "RUNWATCH_ACTION_PUBLIC_KEYS": public}
        run_id = "quickstart-up"
        with Browser(chromium) as browser:
            browser.open(page_url, "document.getElementById('state')?.textContent.startsWith('updated')")
            assert browser.evaluate(ROW.format(run=run_id)) is None
            # the README's example, as a user runs it, while the page is open (no reload from here on)
            trainer = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--run-id", run_id, "--steps", "160"],
                cwd=tmp_path,
                env=trainer_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            try:
                out, _ = trainer.communicate(timeout=400)
            finally:
                if trainer.poll() is None:
                    trainer.kill()
            assert trainer.returncode == 0, out[-4000:]
            # the corrupted batch's update is skipped by the step guard before it lands; the worker alerts
            assert re.search(r"step 70: update skipped \(non-finite gradient", out), out[-4000:]
            assert re.search(r"step \d+: alert applied: non-finite loss", out), out[-4000:]
            assert "rollback applied" not in out, out[-4000:]
            row_js = ROW.format(run=run_id)
            shown = (
                f"[{row_js}?.querySelector('.status').textContent, "
                f"Array.from({row_js}?.querySelectorAll('.badge') || []).map(b => b.textContent)]"
            )
            status, badges = eventually(
                lambda: browser.evaluate(shown),
                lambda seen: (
                    seen[0] == "completed" and {t.split()[0] for t in seen[1]} >= {"alert", "warning"}
                ),
                30,
                "the page to show the run completed, with its finding and its alert",
            )
            link = browser.evaluate(f"{row_js}.querySelector('a').href")
            assert link == f"{page_url}runs/{run_id}"
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            browser.screenshot(ARTIFACTS / "local-page.png")
            assert browser.console_errors == []
            # the run's report, served live from the store by the same process
            drawn = browser.open(link, "document.body?.dataset.drawn", timeout=90)
            assert int(drawn) == int(browser.evaluate("document.body.dataset.panels")) > 0
            assert browser.console_errors == []

        # the commands read through the page while `up` holds the embedded store
        listed = runwatch(tmp_path, "runs", "--json")
        assert listed.returncode == 0, listed.stderr
        [row] = [r for r in json.loads(listed.stdout)["runs"] if r["run_id"] == run_id]
        # the NaN batch skipped by the step guard: a warning and an alert, nothing to roll back
        assert (
            row["status"] == "completed"
            and row["actions"].get("alert", 0) >= 1
            and row["actions"].get("rollback", 0) == 0
            and row["findings"]["warning"] >= 1
        ), row
        table = runwatch(tmp_path, "runs")
        assert table.returncode == 0 and run_id in table.stdout, table.stderr
        report = runwatch(tmp_path, "report", run_id, "--out", "r.html")
        assert report.returncode == 0, report.stderr
        assert (tmp_path / "r.html").stat().st_size > 100_000 and "Traceback" not in report.stderr
        verdict = runwatch(tmp_path, "baseline", "check", run_id, "--json")
        assert verdict.returncode == 0, verdict.stderr  # no history for this job: not an outlier
        assert json.loads(verdict.stdout)["run_id"] == run_id
        unknown = runwatch(tmp_path, "report", "no-such-run")
        assert unknown.returncode == 2 and unknown.stderr.startswith("error: unknown run 'no-such-run'")

        # Ctrl-C: everything stops, cleanly
        os.killpg(up.proc.pid, signal.SIGINT)
        assert up.proc.wait(120) == 0, "\n".join(up.lines)
        up._reader.join(10)
        assert up.lines[-1] == "stopped", up.lines[-5:]
        assert not (tmp_path / ".runwatch" / "clickhouse.page.json").exists()
    finally:
        up.kill()
    # the store is the user's again, and nothing stored was lost
    after = runwatch(tmp_path, "runs", "--json")
    assert after.returncode == 0, after.stderr
    [stored] = [r for r in json.loads(after.stdout)["runs"] if r["run_id"] == run_id]
    assert stored == row


def test_a_busy_page_port_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = runwatch(tmp_path, "up", "--page-port", str(port), timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: the page's port {port} on 127.0.0.1 is in use: give --page-port N (0 picks a free one)"
    ]


def processes_mentioning(*needles: str) -> list[int]:
    """The pids whose command line holds every one of ``needles``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found


def test_a_killed_stack_leaves_no_process_behind(tmp_path):
    up = Up(tmp_path, "--page-port", "0")
    try:
        up.wait_for("Ctrl-C stops everything.", timeout=300)
        port = up.line(r"export RUNWATCH_BOOTSTRAP=127\.0\.0\.1:(\d+)").group(1)
        worker = processes_mentioning("runwatch.cli", "worker", str(tmp_path))
        broker = processes_mentioning("tansu", f"tcp://127.0.0.1:{port}")
        assert worker and broker, (worker, broker)
        os.killpg(up.proc.pid, signal.SIGKILL)  # no Ctrl-C: nothing of the stack's own stops them
        up.proc.wait(10)
        eventually(
            lambda: (
                processes_mentioning("runwatch.cli", "worker", str(tmp_path))
                + processes_mentioning("tansu", f"tcp://127.0.0.1:{port}")
            ),
            lambda left: left == [],
            30,
            "the worker and the broker to end with runwatch up",
        )
    finally:
        up.kill()
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


def test_a_dead_broker_is_said_within_10_s_and_up_stops_within_30_s(tmp_path):
    """Issue 35: after its broker died `runwatch up` said nothing, its page kept answering, and Ctrl-C (then
    SIGTERM) hung for minutes."""
    up = Up(tmp_path, "--page-port", "0")
    try:
        up.wait_for("Ctrl-C stops everything.", timeout=300)
        port = up.line(r"export RUNWATCH_BOOTSTRAP=127\.0\.0\.1:(\d+)").group(1)
        (broker,) = processes_mentioning("tansu", f"tcp://127.0.0.1:{port}")
        os.kill(broker, signal.SIGKILL)
        killed = time.monotonic()
        up.wait_for("error: the embedded broker exited", timeout=10)
        said = time.monotonic() - killed
        with contextlib.suppress(ProcessLookupError):  # (it may have stopped already)
            os.killpg(up.proc.pid, signal.SIGINT)  # and Ctrl-C, as its user would
        up.proc.wait(30)
        stopped = time.monotonic() - killed
    finally:
        up.kill()
    assert up.proc.returncode == 1, "\n".join(up.lines)  # a part failed: exit 1, as for a dead worker
    assert not processes_mentioning("runwatch.cli", "worker", str(tmp_path))
    print(f"broker killed: said after {said:.1f} s, stopped after {stopped:.1f} s")


def test_the_stack_is_its_owners_alone(tmp_path):
    """Issue 35's smaller items: `.runwatch/env` works from any folder (it read the secret by a relative
    path); `.runwatch/` is its owner's alone; a second `runwatch up` on the same folder names who holds it (it
    printed chdb's lock error); the page answers only at a loopback name (DNS rebinding)."""
    import http.client

    up = Up(tmp_path, "--page-port", "0")
    try:
        up.wait_for("Ctrl-C stops everything.", timeout=300)
        page = up.line(r"page\s+http://127\.0\.0\.1:(\d+)/")
        port = int(page.group(1))
        sourced = subprocess.run(
            ["bash", "-c", f"source {tmp_path / '.runwatch' / 'env'} && env"],
            cwd="/",
            env=CLEAN_ENV,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        exported = dict(line.split("=", 1) for line in sourced.splitlines() if line.startswith("RUNWATCH_"))
        assert exported and all(exported.values()), exported  # every value there, read from /
        # What the training shell gets holds no key that signs an action (issue 35): the bootstrap and the
        # worker's public key. A stop forged with every piece of it, and with the file itself, verifies with
        # none of the stack's keys, while one the worker's key signs does.
        assert set(exported) == {"RUNWATCH_BOOTSTRAP", "RUNWATCH_ACTION_PUBLIC_KEYS"}, exported
        public = ActionPublicKeys.parse(exported["RUNWATCH_ACTION_PUBLIC_KEYS"])
        worker_key = ActionSigningKey.from_pem(
            (tmp_path / ".runwatch" / "action-signing-key.pem").read_bytes()
        )
        assert public.key_ids == [worker_key.key_id]
        now = utc_now()
        stop = Action(
            action_id="forged", run_id="victim", kind="stop", reason="f", issued_at=now, expires_at=now
        )
        materials = trainer_materials(*exported.values(), (tmp_path / ".runwatch" / "env").read_text())
        forged = forgeries(stop, materials, worker_key.key_id)
        assert forged and not [a for a in forged if public.verify(a)]
        assert public.verify(worker_key.sign(stop))
        assert stat.S_IMODE((tmp_path / ".runwatch").stat().st_mode) == 0o700
        second = runwatch(tmp_path, "up", "--page-port", "0", timeout=120)
        assert second.returncode == 2, second.stdout + second.stderr
        assert second.stderr.strip().splitlines() == [
            f"error: another runwatch up (pid {up.proc.pid}) holds {tmp_path / '.runwatch'}: stop it (Ctrl-C "
            f"in its shell, or kill {up.proc.pid}), or give this one another --state-dir"
        ], second.stderr

        def get(host: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("GET", "/api/runs", headers={"Host": host})
                return conn.getresponse().status
            finally:
                conn.close()

        assert get(f"127.0.0.1:{port}") == 200 and get(f"localhost:{port}") == 200
        assert get(f"rebound.example:{port}") == 403
    finally:
        up.kill()
