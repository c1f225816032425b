"""Actions applied in step across ranks, with 3 real gloo ranks and listeners fed as the consumer
thread would feed them: an action the other ranks receive later (or earlier) than rank 0 is
applied by all three at the same poll, a rollback restores the same checkpoint everywhere, an
action a rank never receives is applied from rank 0's signed copy after the timeout instead of
hanging it, and a pause holds every rank until its resume. And the stop watchdog: armed on receipt, it ends a
process whose main thread never reaches poll(). After a restart, an action that one rank applied before it
(its state file says so) is applied by no rank, nobody waits for it, and the ranks stay in step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runwatch.contract.schema import Action, CheckpointRef
from runwatch.producer.actions.checkpoints import save_checkpoint
from runwatch.producer.actions.listener import ActionListener
from runwatch.producer.instrument.heartbeat import Heartbeat
from tests.producer.test_actions_unit import PUBLIC_KEYS, RecordingPublisher, action, deliver

pytestmark = pytest.mark.integration  # starts processes (issue 25: not in `make test-fast`)

WORLD = 3
POLL_S = 0.05  # the loop's step between polls
POLLS = 16
SYNC_TIMEOUT_S = 0.5
REPO = Path(__file__).resolve().parents[2]


def _rank(rank: int, init_file: str, out_dir: str, actions_json: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    plan = {k: Action.model_validate_json(v) for k, v in json.loads(actions_json).items()}
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rw = RecordingPublisher(run_id="run-u", rank=rank)
    heartbeat = Heartbeat(rw, interval_s=60)  # not started: beats by hand below
    listener = ActionListener(
        rw,
        model,
        optimizer,
        public_keys=PUBLIC_KEYS,
        consume=False,
        sync_timeout_s=SYNC_TIMEOUT_S,
        heartbeat=heartbeat,
    )
    leader = rank == 0
    torch.manual_seed(100 + rank)  # each rank's training drifts its own way until the rollback

    def later(delay: float, *actions: Action) -> None:
        timer = threading.Timer(delay, deliver, (listener, *actions))
        timer.daemon = True
        timer.start()

    log = []
    for i in range(POLLS):
        if i == 2 and leader:
            save_checkpoint(checkpoint, model, optimizer)
        if i == 3:  # rank 0 receives the rollback now, the others two polls later
            if leader:
                deliver(listener, plan["rollback"])
            else:
                later(2 * POLL_S, plan["rollback"])
        if i == 6 and not leader:  # the others receive an alert two polls before rank 0 does
            deliver(listener, plan["early_alert"])
        if i == 8 and leader:
            deliver(listener, plan["early_alert"])
        if i == 10 and leader:  # only rank 0 ever receives this one
            deliver(listener, plan["lost"])
        if i == 12:  # everyone pauses; the resume reaches each rank at its own moment
            deliver(listener, plan["pause"])
            later(0.3 + 0.1 * rank, plan["resume"])
        if i == 11:
            heartbeat.beat()  # between polls: in_sync not measured
        if i == 13:  # rank 0 is late to this poll: the others wait for it inside poll, in sync
            if leader:
                time.sleep(0.3)
            else:
                threading.Timer(0.15, heartbeat.beat).start()
        if i == 14:
            deliver(listener, plan["stop"])
        started = time.monotonic()
        results = listener.poll(step=100 + i)
        for r in results:
            log.append(
                {
                    "poll": i,
                    "kind": r.kind,
                    "outcome": r.outcome,
                    "to_step": r.to_step,
                    "detail": r.detail,
                    "id": r.action.action_id,
                    "waited": time.monotonic() - started,
                    "weight": float(model.weight.detach().double().sum()) if r.kind == "rollback" else None,
                }
            )
        if any(r.kind == "stop" for r in results):
            break
        loss = model(torch.randn(4, 8)).pow(2).mean()  # one local training step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(POLL_S)
    acks = [(a.action_id, a.outcome, a.rank) for a in rw.acks()]
    beats = [(e.step, e.in_sync) for e in rw.events if e.kind == "heartbeat"]
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"log": log, "acks": acks, "beats": beats, "synced": listener.synced})
    )
    # Leave together and skip interpreter teardown, which can abort on gloo's threads (see test_ddp_timing).
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], dict[str, Action], float]:
    tmp = tmp_path_factory.mktemp("sync")
    uri = str(tmp / "c2.pt")
    plan = {
        "rollback": action("rollback", target=CheckpointRef(step=2, uri=uri), params={"lr_scale": 0.5}),
        "early_alert": action("alert"),
        "lost": action("alert"),
        "pause": action("pause", params={"timeout_s": 10}),
        "resume": action("resume"),
        "stop": action("stop"),
    }
    actions_json = json.dumps({k: v.model_dump_json() for k, v in plan.items()})
    started = time.monotonic()
    ctx = mp.start_processes(
        _rank,
        args=(str(tmp / "rendezvous"), str(tmp), actions_json, uri),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    while not ctx.join(timeout=1):  # raises if a rank failed
        assert time.monotonic() - started < 90, "ranks did not finish"
    reference = float(torch.load(uri, weights_only=False)["model"]["weight"].double().sum())
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)], plan, reference


def by_id(log: list[dict], action_id: str) -> list[dict]:
    return [e for e in log if e["id"] == action_id]


def test_every_rank_runs_with_sync_on(ranks):
    results, _plan, _ref = ranks
    assert all(r["synced"] for r in results)


def test_a_rollback_received_late_elsewhere_is_applied_at_the_same_poll_with_the_same_checkpoint(ranks):
    results, plan, reference = ranks
    applied = [by_id(r["log"], plan["rollback"].action_id) for r in results]
    assert all(len(a) == 1 for a in applied), applied
    assert {(a[0]["poll"], a[0]["outcome"], a[0]["to_step"]) for a in applied} == {(3, "applied", 2)}
    # same state everywhere
    assert all(a[0]["weight"] == pytest.approx(reference, abs=1e-12) for a in applied)
    assert all(a[0]["waited"] >= 1.5 * 0.05 for a in applied[1:])  # the others waited for their copy


def test_an_action_received_early_elsewhere_waits_for_rank_0(ranks):
    results, plan, _ref = ranks
    polls = [[e["poll"] for e in by_id(r["log"], plan["early_alert"].action_id)] for r in results]
    assert polls == [[8], [8], [8]]


def test_an_action_a_rank_never_receives_is_applied_from_rank_0s_signed_copy_after_the_timeout(ranks):
    results, plan, _ref = ranks
    lost = [by_id(r["log"], plan["lost"].action_id) for r in results]
    # every rank applies it at the same poll: the others from rank 0's copy, which verifies here
    assert [(e[0]["poll"], e[0]["outcome"]) for e in lost] == [(10, "applied")] * 3
    for entry in lost[1:]:
        assert SYNC_TIMEOUT_S * 0.9 <= entry[0]["waited"] < SYNC_TIMEOUT_S + 5
    for rank, r in enumerate(results):
        assert (plan["lost"].action_id, "applied", rank) in [tuple(a) for a in r["acks"]]


def test_a_pause_holds_every_rank_until_its_resume_and_a_stop_ends_every_rank_at_the_same_poll(ranks):
    results, plan, _ref = ranks
    for r in results:
        twelve = [(e["kind"], e["poll"]) for e in r["log"] if e["poll"] == 12]
        assert twelve == [("pause", 12), ("resume", 12)], r["log"]
        pause = by_id(r["log"], plan["pause"].action_id)[0]
        assert f"until resume {plan['resume'].action_id}" in pause["detail"] and pause["waited"] >= 0.25
        assert [(e["kind"], e["poll"]) for e in r["log"]][-1] == ("stop", 14)


CHILD = textwrap.dedent("""
    import sys, threading, time
    sys.path.insert(0, {repo!r})
    from tests.producer.test_actions_unit import RecordingPublisher, action, deliver
    from runwatch.producer.actions.listener import ActionListener

    listener = ActionListener(RecordingPublisher(), public_keys={public_keys!r}, consume=False,
                              stop_exit_after_s=1.0, stop_exit_code=7)
    threading.Timer(0.2, deliver, (listener, action("stop"))).start()  # the consumer thread's receipt
    print("blocked", time.monotonic(), flush=True)
    time.sleep(60)  # stuck in a collective: poll() is never reached
    print("woke up", flush=True)
    """)


def test_a_stop_arms_the_watchdog_on_receipt_for_a_rank_that_never_polls():
    code = CHILD.format(repo=str(REPO), public_keys=PUBLIC_KEYS)
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        line = child.stdout.readline()
        blocked = time.monotonic()
        assert line.startswith("blocked"), child.stderr.read()
        returncode = child.wait(timeout=30)
        elapsed = time.monotonic() - blocked
    finally:
        child.kill()
    assert returncode == 7, child.stderr.read()
    assert 1.0 <= elapsed < 1.2 + 3.0, elapsed  # receipt 0.2 s + deadline 1.0 s, with a margin
    assert "woke up" not in child.stdout.read()
    assert "exiting with code 7" in child.stderr.read()


def test_arming_again_keeps_one_watchdog_and_the_earlier_deadline():
    listener = ActionListener(
        RecordingPublisher(), public_keys=PUBLIC_KEYS, consume=False, stop_exit_after_s=60.0
    )
    try:
        deliver(listener, action("stop"))  # armed on receipt
        first = listener.watchdog.thread
        [applied] = listener.poll(step=1)  # and again when applied: still the one watchdog
        assert applied.kind == "stop" and listener.watchdog.thread is first and first.is_alive()
        assert listener.stop_deadline(120.0) is first  # a later deadline changes nothing
        deadline = listener.watchdog.deadline
        assert deadline - time.monotonic() < 60.0
        assert listener.stop_deadline(30.0) is first and listener.watchdog.deadline < deadline
        assert [t.name for t in threading.enumerate()].count("runwatch-stop-watchdog") == 1
    finally:
        listener.disarm_stop_deadline()
    first.join(5)
    assert not first.is_alive()


def test_a_rank_waiting_inside_poll_for_a_late_rank_0_says_in_sync(ranks):
    results, _plan, _ref = ranks
    assert results[0]["beats"] == [[None, None]]
    for r in results[1:]:
        assert r["beats"] == [[None, None], [None, True]], r["beats"]


# -- a restart: one rank remembers an action the others do not ----------------------------------------

RESTART_POLLS = 10
RESTART_SYNC_TIMEOUT_S = 5.0  # long, so that a wait for the dropped action would show


def _restarted_rank(rank: int, init_file: str, out_dir: str, actions_json: str, state_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30)
    )
    plan = {k: Action.model_validate_json(v) for k, v in json.loads(actions_json).items()}
    rw = RecordingPublisher(run_id="run-u", rank=rank)
    state = Path(state_dir, f"r{rank}.actions")
    listener = ActionListener(
        rw,
        torch.nn.Linear(2, 2),
        public_keys=PUBLIC_KEYS,
        consume=False,
        sync_timeout_s=RESTART_SYNC_TIMEOUT_S,
        state_path=state,
    )
    loaded = len(listener.applied_ids)
    log = []
    for i in range(RESTART_POLLS):
        if i == 2 and rank != 2:  # the action from before the restart, redelivered; rank 2 gets it late
            deliver(listener, plan["old"])
        if i == 5 and rank == 2:
            deliver(listener, plan["old"])
        if i == 4:
            deliver(listener, plan["fresh"])
        if i == 7:
            deliver(listener, plan["stop"])
        started = time.monotonic()
        results = listener.poll(step=i)
        waited = time.monotonic() - started
        log += [{"poll": i, "kind": r.kind, "id": r.action.action_id, "outcome": r.outcome} for r in results]
        log.append({"poll": i, "waited": waited})
        if any(r.kind == "stop" for r in results):
            break
        time.sleep(POLL_S)
    Path(out_dir, f"restart{rank}.json").write_text(
        json.dumps(
            {
                "log": log,
                "ignored": dict(listener.ignored),
                "loaded": loaded,
                "synced": listener.synced,
                "acks": [a.action_id for a in rw.acks()],
                "state": json.loads(state.read_text())["applied"],
            }
        )
    )
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_an_action_one_rank_applied_before_a_restart_is_applied_by_none_and_nobody_waits(tmp_path):
    plan = {
        "old": action("rollback", params={"lr_scale": 0.5}),
        "fresh": action("alert"),
        "stop": action("stop"),
    }
    # Before the restart rank 1 applied "old" and wrote it down; rank 0's and rank 2's files were lost.
    Path(tmp_path, "r1.actions").write_text(
        json.dumps({"applied": ["something-older", plan["old"].action_id]})
    )
    actions_json = json.dumps({k: v.model_dump_json() for k, v in plan.items()})
    started = time.monotonic()
    ctx = mp.start_processes(
        _restarted_rank,
        args=(str(tmp_path / "rendezvous"), str(tmp_path), actions_json, str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    while not ctx.join(timeout=1):  # raises if a rank failed
        assert time.monotonic() - started < 90, "ranks did not finish"
    results = [json.loads((tmp_path / f"restart{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["synced"] for r in results)
    assert [r["loaded"] for r in results] == [0, 2, 0]
    for rank, r in enumerate(results):
        applied = [(e["poll"], e["kind"]) for e in r["log"] if "kind" in e]
        assert applied == [(4, "alert"), (7, "stop")], (rank, r["log"])  # the old rollback nowhere, in step
        assert r["acks"] == [plan["fresh"].action_id, plan["stop"].action_id]
        # rank 0 held it when the ranks agreed, rank 1 refused it on arrival, rank 2 when it came late
        assert r["ignored"] == {"already_applied": 1}, (rank, r["ignored"])
        assert plan["old"].action_id in r["state"] and r["state"][-2:] == [
            plan["fresh"].action_id,
            plan["stop"].action_id,
        ]
        # nobody waited for the dropped action
        assert max(e["waited"] for e in r["log"] if "waited" in e) < RESTART_SYNC_TIMEOUT_S / 2, r["log"]
