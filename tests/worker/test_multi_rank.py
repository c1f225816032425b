"""Many ranks, one run: real 3-rank torch.distributed (gloo, DDP on CPU) training against the real
broker and a real Faust worker. The join, the straggler, a hung rank escalated to a stop that every
rank honours, a killed rank, a rollback that cures the run, one that cannot (the cap), and a long
checkpoint that is not a stall."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly, JoinedStep
from runwatch.local.broker import EmbeddedBroker, ensure_topics, free_port
from tests.conftest import read_topic, worker_with_config

pytestmark = pytest.mark.integration

WORLD = 3
SCRIPT = Path(__file__).parents[1] / "support" / "dist_train.py"
STOP_EXIT_CODE = 3  # dist_train.STOP_EXIT_CODE: the stop watchdog's hard exit

# The test worker's config: the defaults with timeouts scaled down to test-sized runs, and a
# rollback for a gradient explosion.
CONFIG = {
    "detectors": {
        "stall": {
            "phase_allowance_s": {
                "train": 3.0,
                "dataload": 3.0,
                "eval": 900.0,
                "checkpoint": 900.0,
                "idle": 3600.0,
            },
            "heartbeat_timeout_s": 4.0,
            "min_steps": 5,
        },
        "hung_rank": {
            "phase_allowance_s": {
                "train": 2.0,
                "dataload": 2.0,
                "eval": 900.0,
                "checkpoint": 900.0,
                "idle": 3600.0,
            },
            "floor_s": 1.0,
        },
        # 3 ranks on 2 shared cores: a rank's compute time wanders by tens of ms, so a straggler must
        # be clearly slower (the slow rank sleeps 200 ms a step). Rank 0 does real extra work here (it
        # computes the full gradient norm the test checks against, and saves the checkpoints), which on
        # a loaded CI machine made it a straggler too at a 30 ms gap (80 ms sleep)
        "straggler": {"min_steps": 10, "patience": 5, "min_gap_s": 0.1},
        # any grad spike rolls back here (the rules below), so no divergence wait: checkpoints
        # every 10 steps are confirmed 3 healthy steps later
        "loss_spike": {"divergence_steps": 0},
        "grad_norm_spike": {"divergence_steps": 0},
    },
    # the join's default (10 s): the worker ticks a run on its wall clock since the run's last event
    # arrived, so a worker that falls seconds behind its input on a loaded machine (3 ranks, the broker,
    # the worker and the sink on 2 cores) times a step out before reading a rank's report of it; a CI
    # run saw that with 3 s at step 12
    "join": {"timeout_s": 10.0},
    "policy": {
        "rules": [
            {"detector": "non_finite", "min_severity": "critical", "action": "rollback"},
            # (a spike whose update the step guard skipped is info: the weights never saw it)
            {"detector": "grad_norm_spike", "min_severity": "warning", "action": "rollback"},
            {"detector": "*", "min_severity": "warning", "action": "alert"},
        ],
        "escalate_after_s": 3.0,
        "max_rollbacks": 2,
        "skip_data_window": True,
        "cooldown_s": 1.0,
        "confirm_steps": 3,
    },
}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A broker of this module's own: only its worker reads these runs. On the session's broker the
    default-config worker publishes its findings of them beside this one's, and its stricter straggler
    gap (5 ms) named rank 0, which computes the full gradient norm, on a loaded CI run."""
    with EmbeddedBroker(log_path=tmp_path_factory.mktemp("dist-broker") / "broker.log") as b:
        ensure_topics(b.bootstrap)
        yield b


@pytest.fixture(scope="module")
def dist_worker(broker, action_keys, tmp_path_factory):
    """The only worker of this module's broker, running CONFIG."""
    with worker_with_config(
        broker, action_keys, tmp_path_factory.mktemp("dist-worker"), CONFIG, "runwatch-detect-dist"
    ) as worker:
        yield worker


class Run:
    """``world`` (3) ranks of ``dist_train.py`` as child processes, killed by pid at the end."""

    def __init__(
        self,
        broker,
        public_keys: str,
        folder: Path,
        *faults: str,
        steps: int = 60,
        shard: bool = False,
        stop_exit_after_s: float = 20.0,
        step_sleep: float = 0.0,
        guard: bool = True,
        world: int = WORLD,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.world = world
        self.run_id = f"dist-{uuid.uuid4().hex[:8]}"
        self.world = world
        self.folder = folder
        self.bootstrap = broker.bootstrap
        port = free_port()
        env = {**__import__("os").environ, **(env or {}), topics.PUBLIC_KEYS_ENV: public_keys}
        self.procs = []
        for rank in range(world):
            cmd = [
                sys.executable,
                str(SCRIPT),
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--port",
                str(port),
                "--bootstrap",
                broker.bootstrap,
                "--run-id",
                self.run_id,
                "--out",
                str(folder),
                "--steps",
                str(steps),
                "--stop-exit-after-s",
                str(stop_exit_after_s),
                "--step-sleep",
                str(step_sleep),
            ]
            cmd += [arg for f in faults for arg in ("--fault", f)]
            cmd += extra_args
            if shard:
                cmd.append("--shard")
            if not guard:
                cmd.append("--no-guard")
            log = open(folder / f"rank{rank}.log", "wb")
            # Two simulated nodes, {0, 1} and {2}, each with its own node-local folder: under rank sync only
            # LOCAL_RANK 0 of a node reads the action topic (rank 1 reads through its node's reader)
            node = folder / f"node{rank // 2}"
            node.mkdir(exist_ok=True)
            rank_env = {**env, "LOCAL_RANK": str(rank % 2), "RUNWATCH_STOP_RELAY_DIR": str(node)}
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env, start_new_session=True
                )
            )

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    def result(self, rank: int) -> dict:
        return json.loads((self.folder / f"result-{rank}.json").read_text())

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r}\n" + (self.folder / f"rank{r}.log").read_text()[-3000:] for r in range(self.world)
        )

    def anomalies(self, until, timeout: float = 60.0) -> list[Anomaly]:
        return self._read(topics.ANOMALIES, Anomaly, until, timeout)

    def actions(self, until, timeout: float = 60.0) -> list[Action]:
        return self._read(topics.ACTIONS, Action, until, timeout)

    def joined(self, until, timeout: float = 60.0) -> list[JoinedStep]:
        return self._read(topics.JOINED, JoinedStep, until, timeout)

    def _read(self, topic: str, model, until, timeout: float) -> list:
        def mine(records: list) -> list:
            out = []
            for r in records:
                item = model.model_validate_json(r.value)
                if item.run_id == self.run_id:
                    out.append(item)
            return out

        return mine(read_topic(self.bootstrap, topic, lambda records: bool(until(mine(records))), timeout))


@pytest.fixture
def run_factory(broker, action_keys, dist_worker, tmp_path):
    runs: list[Run] = []

    def start(*faults: str, **options) -> Run:
        folder = tmp_path / f"run{len(runs)}"
        folder.mkdir()
        run = Run(broker, action_keys.public_text, folder, *faults, **options)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


def test_joined_sharded_norms_a_straggler_and_a_long_checkpoint_that_is_no_stall(run_factory):
    # (every rank's heartbeats carry a fake NVML's figures; rank 2's report a thermal throttle: dist_train.py)
    run = run_factory(
        "slow:2:0.2", "long_checkpoint:20:6", steps=60, shard=True, env={"RUNWATCH_TEST_FAKE_NVML": "2"}
    )
    codes = run.wait(180)
    assert codes == [0, 0, 0], run.logs()
    full = {int(k): v for k, v in run.result(0)["full_grad_norms"].items()}
    assert len(full) == 60
    joined = run.joined(lambda got: {j.step for j in got} >= set(full))
    by_step = {j.step: j for j in joined}
    for step, norm in full.items():
        j = by_step[step]
        delivery = {r: (run.result(r)["published"], run.result(r)["drop_reasons"]) for r in range(WORLD)}
        assert j.complete and j.ranks_reported == [0, 1, 2] and j.grad_sharded, (
            step,
            j.ranks_missing,
            delivery,
        )
        assert j.grad_norm == pytest.approx(norm, rel=1e-5), step
    anomalies = run.anomalies(lambda got: any(a.detector == "straggler" for a in got))
    stragglers = [a for a in anomalies if a.detector == "straggler"]
    assert {a.rank for a in stragglers} == {2}
    assert stragglers[0].evidence["timed"] == "compute_s"
    gpu = stragglers[0].evidence["gpu"]  # the straggler's GPU health, from its heartbeats
    assert gpu["rank"] == 2 and gpu["latest"]["throttle_reasons"] == ["sw_thermal_slowdown"]
    assert "rank 2: thermal throttle since " in stragglers[0].message
    assert "(SM clock 1110 of 1980 MHz" in stragglers[0].message
    # rank 0 saved for 6 s while ranks 1 and 2 waited for it: neither a stall nor a hang
    stalls = [a for a in anomalies if a.detector in ("stall", "hung_rank")]
    assert stalls == [], [(a.detector, a.rank, a.step, a.message, a.evidence) for a in stalls]
    assert all(run.result(r)["status"] == "completed" for r in range(WORLD))


def test_a_hung_rank_is_named_and_the_escalated_stop_ends_every_rank(run_factory):
    run = run_factory("hang:1:25", steps=400, stop_exit_after_s=2.0)
    codes = run.wait(120)
    assert codes == [STOP_EXIT_CODE] * WORLD, run.logs()  # all three, hard exit: none could stop gracefully
    anomalies = run.anomalies(lambda got: any(a.detector == "hung_rank" for a in got))
    (hung,) = [a for a in anomalies if a.detector == "hung_rank"]
    assert hung.rank == 1 and hung.evidence["kind"] == "peers_waiting" and hung.step == 24
    # within the documented timeout: max(floor, 3 x median step + train allowance), plus the
    # heartbeat period (0.5 s) and the worker's tick (0.25 s)
    assert hung.threshold < hung.value <= hung.threshold + 1.0
    actions = run.actions(lambda got: any(a.kind == "stop" for a in got))
    (stop,) = [a for a in actions if a.kind == "stop"]
    assert stop.params["cause"] == "escalation"


def test_a_killed_rank_is_found_dead_from_its_missing_heartbeats(run_factory):
    run = run_factory("kill:2:25", steps=400, stop_exit_after_s=2.0)
    anomalies = run.anomalies(
        lambda got: any(a.detector == "stall" and a.evidence.get("kind") == "silent" for a in got), timeout=90
    )
    silent = [a for a in anomalies if a.detector == "stall" and a.evidence["kind"] == "silent"]
    assert [a.rank for a in silent] == [2]
    assert silent[0].threshold == 4.0 and 4.0 < silent[0].value <= 5.0
    codes = run.wait(60)
    assert codes[2] == -9 and codes[:2] == [STOP_EXIT_CODE] * 2, run.logs()


def test_a_grad_explosion_is_rolled_back_with_the_lr_scaled_and_the_run_finishes_healthy(run_factory):
    # (the step guard off: it would skip the exploding update itself, as the next test shows)
    run = run_factory("bad_batch:35", steps=60, step_sleep=0.1, guard=False)
    codes = run.wait(180)
    assert codes == [0, 0, 0], run.logs()
    results = [run.result(r) for r in range(WORLD)]
    for result in results:
        assert result["status"] == "completed"
        # (a `recovered` may or may not arrive before the run's last step: the worker's check below)
        (rollback,) = [a for a in result["applied"] if a["kind"] not in ("alert", "recovered")]
        assert rollback["kind"] == "rollback" and rollback["outcome"] == "applied"
        assert rollback["to_step"] == 30 and rollback["lr_scale"] == 0.5 and rollback["skip"] == [31, 35]
        assert result["lr"] == pytest.approx(0.05 * 0.5)
    # every rank applied every action at the same step
    assert len({json.dumps([(a["kind"], a["at"]) for a in r["applied"]]) for r in results}) == 1
    # one action-topic consumer per node: rank 1 applied rank 0's copies, read by no consumer of its own
    assert [r["consuming"] for r in results] == [True, False, True]
    actions = run.actions(lambda got: any(a.kind == "recovered" for a in got))
    kinds = [a.kind for a in actions if a.kind in ("rollback", "stop", "recovered")]
    assert kinds == ["rollback", "recovered"]
    # the replay of the three ranks, joined, was judged back at its loss before the fault
    (rollback_action,) = [a for a in actions if a.kind == "rollback"]
    (recovered,) = [a for a in actions if a.kind == "recovered"]
    assert recovered.params["rollback_action_id"] == rollback_action.action_id


def test_every_rank_skips_the_same_exploding_update_and_the_replicas_stay_equal(run_factory):
    """Issue 37: the step guard decides on each rank from the gradient DDP already averaged, so every
    rank skips the same update; the replicas' weights stay bit-equal, and no rollback is needed."""
    run = run_factory("bad_batch:35", steps=60, step_sleep=0.05)
    codes = run.wait(180)
    assert codes == [0, 0, 0], run.logs()
    results = [run.result(r) for r in range(WORLD)]
    assert [r["skipped_steps"] for r in results] == [[35]] * WORLD
    assert len({r["weights"] for r in results}) == 1  # the replicas never drifted apart
    assert all(r["status"] == "completed" for r in results)
    assert all(r["applied"] == [] for r in results), results[0]["applied"]  # the spike is info: no action


def test_a_fault_that_repeats_after_each_rollback_reaches_the_cap_and_stops(run_factory):
    run = run_factory("bad_step:35", steps=200, step_sleep=0.1, guard=False)
    codes = run.wait(240)
    assert codes == [0, 0, 0], run.logs()  # stopped gracefully
    for rank in range(WORLD):
        result = run.result(rank)
        assert result["status"] == "stopped"
        applied = [a for a in result["applied"] if a["kind"] != "alert"]
        assert [a["kind"] for a in applied] == ["rollback", "rollback", "stop"]
        assert [a["lr_scale"] for a in applied[:2]] == [0.5, 0.25]
    assert (
        len({json.dumps([(a["kind"], a["at"]) for a in run.result(r)["applied"]]) for r in range(WORLD)}) == 1
    )
    actions = run.actions(lambda got: any(a.kind == "stop" for a in got))
    (stop,) = [a for a in actions if a.kind == "stop"]
    assert stop.params["cause"] == "max_rollbacks"
