"""Issue 35, item 8, on the real broker and worker: one run floods the partition of another run. The flood
is shed over its run's budget (counted, and one dead letter per report names the run and the offsets) and
the victim's NaN streak, sent after the flood, gets its rollback. The delay it takes is the benchmark's
figure (tests/benchmarks/bench_flood.py); here a generous timeout only."""

from __future__ import annotations

import pytest

from runwatch.contract import topics
from runwatch.contract.schema import DeadLetter
from tests.conftest import read_topic
from tests.support.flood_scenario import run_flood

pytestmark = pytest.mark.integration

FLOOD = 60_000


def test_a_flood_on_the_victims_partition_is_shed_and_the_victim_is_rolled_back(
    own_broker, action_keys, tmp_path
):
    outcome = run_flood(own_broker.bootstrap, action_keys.signing, tmp_path, {}, FLOOD, timeout_s=120)
    assert outcome.rollback_kinds[-1:] == ["rollback"], outcome
    shed = outcome.counters["events_shed"]
    # the flood reached the log far faster than its budget (2,000 events/s, bursts of 4,000): most is shed
    assert FLOOD // 2 < shed < FLOOD, outcome

    def letters(records) -> list[DeadLetter]:
        return [DeadLetter.model_validate_json(r.value) for r in records]

    def flood_reported(records) -> bool:
        named = [d for d in letters(records) if d.stage == "budget" and d.key == outcome.flood]
        return sum(int(d.reason.split()[0]) for d in named) == shed

    records = read_topic(own_broker.bootstrap, topics.DEADLETTER, flood_reported, 60)
    named = [d for d in letters(records) if d.stage == "budget"]
    assert {d.key for d in named} == {outcome.flood}  # (nothing of the victim's was shed)
    assert all("over the run's budget" in d.reason and d.partition == outcome.partition for d in named)
