"""A run against its job's history, live, end to end: earlier runs of the job (real torch training,
recorded) are loaded with ``runwatch ingest`` into an embedded ClickHouse that the worker reads
(``--baseline-dsn``); a slower run of the same job publishes to the real broker. The worker flags
it in flight (``baseline_trajectory``: step time above the band) and, when it ends, publishes a
``baseline_outliers`` anomaly and an ``alert``, which ``runwatch remediate`` posts to a real local
HTTP server as an "outlier alert (30-day)"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import orjson
import pytest
import torch
import yaml

from runwatch.contract import topics
from runwatch.producer import RunWatch
from runwatch.producer.publish.recorder import JsonlRecorder
from runwatch.scenarios.threads import one_torch_thread
from tests.conftest import eventually, read_topic, worker_with_config
from tests.sinks.test_remediator_process import Webhook
from tests.support.action_keys import ActionKeys

pytestmark = pytest.mark.integration

HARDWARE = "alert-test-cpu"  # declared, so the history and the live run share a fingerprint on any machine
STEPS = 30
HISTORY_RUNS = 6
BATCH = 32


def train(rw: object, wait_s: float, seed: int) -> None:
    """A small regression, ``wait_s`` of data loading per step (the slower commit waits longer).

    One torch thread: with one per core, tiny steps beside two CPU-bound processes took up to 0.06 s
    at random, which widened the history's band past the slower run (no in-flight finding)."""
    with one_torch_thread():
        _train(rw, wait_s, seed)


def _train(rw: object, wait_s: float, seed: int) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(256, 8)
    y = x.sum(dim=1, keepdim=True)
    for step in range(STEPS):
        started = time.perf_counter()
        time.sleep(wait_s)
        idx = torch.randint(0, 256, (BATCH,))
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        dt = time.perf_counter() - started
        rw.step(step, loss=loss.item(), step_time_s=dt, data_wait_s=wait_s, samples_per_s=BATCH / dt)  # type: ignore[attr-defined]


def shifted_clock(days_ago: float) -> Callable[[], datetime]:
    offset = timedelta(days=days_ago)
    return lambda: datetime.now(UTC) - offset


def runwatch_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runwatch.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_a_slower_run_is_flagged_in_flight_and_its_outlier_alert_reaches_the_webhook(broker, tmp_path):
    action_keys = ActionKeys.generate()  # our own: only this test's worker signs what its remediator runs
    key = f"alert-job-{uuid.uuid4().hex[:8]}"
    recordings = tmp_path / "history"
    recordings.mkdir()
    for i in range(HISTORY_RUNS):  # one run a day for the last six days
        with JsonlRecorder(
            recordings / f"r{i}.jsonl",
            f"{key}-r{i}",
            clock=shifted_clock(HISTORY_RUNS - i),
            collect_metadata=False,
            baseline_key=key,
            tags={"hardware": HARDWARE},
            run_start={"git_sha": f"{i:040x}"},
        ) as rec:
            train(rec, 0.02, seed=i)
    history_dsn = f"chdb://{tmp_path / 'history-clickhouse'}"
    # its own process: chdb's one-process rule
    ingest = runwatch_cli("ingest", str(recordings), "--dsn", history_dsn)
    assert ingest.returncode == 0, ingest.stdout + ingest.stderr

    config = tmp_path / "remediation.yaml"
    with Webhook() as hook:
        config.write_text(yaml.safe_dump({"webhooks": [{"url": hook.url, "kinds": ["alert"]}]}))
        env = {**os.environ, **action_keys.trainer_env}
        remediate = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runwatch.cli",
                "remediate",
                "--bootstrap",
                broker.bootstrap,
                "--config",
                str(config),
                "--dsn",
                f"chdb://{tmp_path / 'remediate-clickhouse'}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            with worker_with_config(
                broker,
                action_keys,
                tmp_path,
                {},
                group=f"alert-{key}",
                extra_args=("--baseline-dsn", history_dsn),
            ):
                run_id = f"{key}-slow"
                with RunWatch(
                    run_id,
                    broker.bootstrap,
                    baseline_key=key,
                    tags={"hardware": HARDWARE},
                    collect_metadata=False,
                    spool=False,
                    run_start={"git_sha": "f" * 40},
                ) as rw:
                    train(rw, 0.06, seed=HISTORY_RUNS)

                def outlier_posts() -> list[dict]:
                    return [
                        p
                        for p in hook.posts
                        if p["json"].get("runwatch", {}).get("run_id") == run_id
                        and "outlier alert" in p["json"]["text"]
                    ]

                eventually(outlier_posts, 90, "the outlier alert's webhook post")
                anomalies = [
                    orjson.loads(r.value)
                    for r in read_topic(
                        broker.bootstrap,
                        topics.ANOMALIES,
                        lambda rs: any(
                            orjson.loads(r.value)["run_id"] == run_id
                            and orjson.loads(r.value)["detector"] == "baseline_outliers"
                            for r in rs
                        ),
                        30,
                    )
                ]
        finally:
            remediate.send_signal(signal.SIGTERM)
            out, _ = remediate.communicate(timeout=30)

    ours = [a for a in anomalies if a["run_id"] == run_id]
    in_flight = [a for a in ours if a["detector"] == "baseline_trajectory" and a["severity"] != "info"]
    assert in_flight, [(a["detector"], a["message"]) for a in ours]
    # before the run ended
    assert in_flight[0]["metric"] == "step_time_s" and in_flight[0]["step"] < STEPS - 1
    outlier = next(a for a in ours if a["detector"] == "baseline_outliers")
    rows = {row["metric"]: row for row in outlier["evidence"]["baseline"]["rows"]}
    assert (
        rows["step_time_median_s"]["verdict"] == "OUTLIER" and rows["step_time_median_s"]["n"] == HISTORY_RUNS
    )
    assert "final_loss" not in rows  # the same training: only the speed regressed

    [post] = outlier_posts()
    text = post["json"]["text"]
    assert text.startswith(f"runwatch *outlier alert (30-day)* for baseline `{key}`: run `{run_id}`")
    line = next(line for line in text.splitlines() if "step_time_median_s" in line)
    assert "30-day median 0.02" in line and line.endswith("*OUTLIER*")
    assert post["json"]["runwatch"]["kind"] == "alert"
    in_flight_posts = [
        p
        for p in hook.posts
        if p["json"].get("runwatch", {}).get("run_id") == run_id and "outlier alert" not in p["json"]["text"]
    ]
    assert in_flight_posts and "where the job's earlier runs were" in in_flight_posts[0]["json"]["text"]
