"""Every command in README.md and docs/ that starts a runwatch process, run as a user meets it (issue 34): its
own process, as a non-root user, from an empty working directory with an empty HOME, with the command line
as the page prints it. The documented commands are the lines of code blocks and the synopses of README's
command table that run `runwatch up`, `broker`, `worker`, `sink`, `remediate` or `demo` (a synopsis without
its optional parts); a new one fails ``test_every_documented_command_is_run_here`` until it is run here too.

What the page leaves to the reader is filled in as a reader would: B is the broker that the page's own
`runwatch broker` started, a ClickHouse server's DSN an embedded store, C and detectors.yaml the defaults
(`runwatch config --defaults`) and R deploy/config/remediate.yaml, written into the empty folder; a fixed
port another process holds becomes a free one."""

from __future__ import annotations

import re
import secrets
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.local.broker import free_port
from runwatch.worker.state.snapshot import STATE_SECRET_ENV
from tests.support.action_keys import ActionKeys
from tests.support.service_process import Sandbox, ServiceProcess, port_free

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
STARTS = re.compile(
    r"(?:^|\s)(?:\$ )?(?:\.venv/bin/)?(runwatch (?:up|broker|worker|sink|remediate|demo)\b.*)"
)
READY_TIMEOUT_S = 120


def _normal(line: str) -> str:
    """A command line without its comment, its synopsis's optional parts and an ellipsis."""
    line = re.sub(r"\s+#.*$", "", line)
    line = re.sub(r"\s*\[[^\]]*\]", "", line)  # ([--config C] and nested-free optional groups)
    return " ".join(line.replace("...", "").split())


def documented_commands() -> dict[str, list[str]]:
    """Command line -> the places it is documented."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        inside = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                inside = not inside
                continue
            candidates = []
            if inside:
                candidates = [line.strip()]
            elif page.name == "README.md" and line.startswith("| `runwatch "):
                candidates = [line.split("`")[1]]  # the command table's synopsis
            for text in candidates:
                m = STARTS.match(text)
                if m and "──" not in text:  # (not README's data-flow drawing)
                    found.setdefault(_normal(m.group(1)), []).append(f"{page.relative_to(REPO)}:{number}")
    return found


# Each documented command line, as it is run here: (environment it needs, how it ends up ready). "signing":
# the workers' RUNWATCH_ACTION_SIGNING_KEY; "public": its public key, RUNWATCH_ACTION_PUBLIC_KEYS (what the
# sink, the remediator and trainers verify with); "state": the workers' RUNWATCH_STATE_SECRET; "bootstrap":
# RUNWATCH_BOOTSTRAP.
# "service": the ready file (its partitions assigned); "prints:TEXT": a line of its output;
# "exits": runs to completion, exit 0.
RUN_HERE: dict[str, tuple[str, ...]] = {
    "runwatch up": ("clean", "prints:runwatch is up"),
    "runwatch broker": ("clean", "prints:export RUNWATCH_BOOTSTRAP="),
    "runwatch broker --port 9092": ("clean", "prints:listening on"),
    "runwatch worker --bootstrap B": ("signing state", "service"),
    "runwatch worker --bootstrap kafka:9092": ("signing state", "service"),
    "runwatch worker --config detectors.yaml --web-port 6066": ("signing state bootstrap", "service"),
    "runwatch sink --bootstrap B": ("public", "service"),
    "runwatch sink --dsn 'http://runwatch:password@clickhouse:8123'": ("public bootstrap", "service"),
    "runwatch remediate --bootstrap B --config R": ("public", "service"),
    "runwatch demo": ("clean", "exits"),
    "runwatch demo --scenario nan --steps 160 --stall-step 40 --stall-s 14": ("clean", "exits"),
    "runwatch demo --scenario nan --bootstrap \"$RUNWATCH_BOOTSTRAP\" --dsn 'http://' --no-worker": (
        "public bootstrap",
        "exits",
    ),
}


def test_the_signing_key_is_the_workers_alone():
    """Only a worker is given the action signing key; everything else that checks actions gets the public key
    (docs/security.md)."""
    signing = {line for line, (needs, _) in RUN_HERE.items() if "signing" in needs.split()}
    assert signing and all(line.startswith("runwatch worker") for line in signing), signing
    assert not [line for line, (needs, _) in RUN_HERE.items() if {"signing", "public"} <= set(needs.split())]


def test_every_documented_command_is_run_here():
    documented = documented_commands()
    missing = {c: where for c, where in documented.items() if c not in RUN_HERE}
    assert not missing, f"documented commands that start a process and are not run by this test: {missing}"
    stale = set(RUN_HERE) - set(documented)
    assert not stale, f"run here but no longer documented: {stale}"


class Reader:
    """Fills in what a page leaves to its reader, and runs the command in an empty folder of its own."""

    def __init__(self, sandbox: Sandbox, keys: ActionKeys):
        self.sandbox, self.keys, self.bootstrap = sandbox, keys, ""
        self.state_secret = secrets.token_hex(32)
        self.stores = sandbox.folder("stores")
        self.runs = 0

    def args(self, line: str, cwd: Path) -> list[str]:
        out = []
        for arg in shlex.split(line)[1:]:
            arg = arg.replace("$RUNWATCH_BOOTSTRAP", self.bootstrap)
            if arg in ("B", "kafka:9092"):
                arg = self.bootstrap
            elif arg.startswith("http://"):  # a ClickHouse server: an embedded store of its own
                arg = f"chdb://{self.stores / f'store-{self.runs}'}"
            elif arg in ("C", "detectors.yaml"):
                defaults = subprocess.run(
                    [sys.executable, "-m", "runwatch.cli", "config", "--defaults"],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=60,
                ).stdout
                (cwd / "detectors.yaml").write_text(defaults)
                arg = "detectors.yaml"
            elif arg == "R":
                (cwd / "remediate.yaml").write_text((REPO / "deploy/config/remediate.yaml").read_text())
                arg = "remediate.yaml"
            elif arg.isdigit() and int(arg) in (9092, 6066) and not port_free(int(arg)):
                arg = str(free_port())
            out.append(arg)
        return out

    def run(self, line: str, env: dict[str, str] | None = None) -> ServiceProcess:
        needs = RUN_HERE[line][0]
        env = dict(env or {})
        if "signing" in needs:  # (a worker's: the only process that signs actions)
            env.update(self.keys.worker_env)
        if "public" in needs:
            env.update(self.keys.trainer_env)
        if "bootstrap" in needs:
            env[topics.BOOTSTRAP_ENV] = self.bootstrap
        if "state" in needs:  # (a worker's: the workers' own key for their snapshots)
            env[STATE_SECRET_ENV] = self.state_secret
        self.runs += 1
        label = f"doc-{self.runs}"
        args = self.args(line, self.sandbox.folder(label, "work"))
        return ServiceProcess(label, args, env, self.sandbox, shown=line)


def wait_printed(proc: ServiceProcess, text: str, timeout: float = READY_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log(100_000).splitlines():
            if text in line:
                return line
        if proc.process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"`{proc.command_line}` printed no {text!r}; its log ends:\n{proc.log()}")


def wait_ready(proc: ServiceProcess, line: str) -> None:
    how = RUN_HERE[line][1]
    if how == "exits":
        proc.wait_exit(600)
    elif how == "service":
        proc.wait_ready(READY_TIMEOUT_S)
    else:
        wait_printed(proc, how.removeprefix("prints:"))


def test_each_documented_command_starts_from_an_empty_directory(sandbox):
    documented = documented_commands()
    reader = Reader(sandbox, ActionKeys.generate())
    # The page's own broker first: it is the B of the rest.
    broker = reader.run("runwatch broker")
    codes: dict[str, int | None] = {}
    try:
        reader.bootstrap = wait_printed(broker, "export RUNWATCH_BOOTSTRAP=").split("=", 1)[1].strip()
        # with RUNWATCH_BOOTSTRAP set it only creates the topics (docs/embedded-broker.md), and exits
        reader.run("runwatch broker", {topics.BOOTSTRAP_ENV: reader.bootstrap}).wait_exit(60)
        # one at a time, each stopped as a user stops it (SIGTERM) before the next: several of them
        # take the same default port, as the pages say
        for line in documented:
            if line != "runwatch broker" and RUN_HERE[line][1] != "exits":
                proc = reader.run(line)
                wait_ready(proc, line)
                codes[line] = proc.stop(60)
        # the --no-worker demo needs a worker: the README's
        worker = reader.run("runwatch worker --bootstrap B")
        try:
            wait_ready(worker, "runwatch worker --bootstrap B")
            for line in documented:
                if RUN_HERE[line][1] == "exits":
                    wait_ready(reader.run(line), line)
        finally:
            worker.stop(60)
    finally:
        codes["runwatch broker"] = broker.stop(60)
    assert all(code == 0 for code in codes.values()), codes
