"""The event time of the last step seen per run and rank, for the worker's metrics
(``runwatch_last_step_timestamp_seconds{run_id, rank}``, metrics_server.py). Pure: no clock, no I/O.

The detector process records every step event here (a dict store: cheap on the hot path) and hands a
bounded copy to its parent at most once a second, when the parent asks (its metrics are on). Bounded:
only the runs the worker holds (a run let go is forgotten here with its monitor), and per run at most
``max_ranks`` ranks: every rank of a run that has that many or fewer, else the ``max_ranks`` most behind
(the oldest last steps). The stall rule ``time() - runwatch_last_step_timestamp_seconds > 60`` fires
on the ranks most behind, so those are the ones kept; a 16,384-rank run makes ``max_ranks`` series,
not 16,384, at the price of series that come and go as the most-behind set changes.
"""

from __future__ import annotations

import heapq
from datetime import datetime

from runwatch.contract.groups import parse_key

MAX_RANKS_PER_RUN = 64


class StepTimes:
    """run key (a split run's group keys included) -> rank -> the newest step event time seen."""

    def __init__(self) -> None:
        self._runs: dict[str, dict[int, datetime]] = {}

    def seen(self, run_key: str, rank: int, ts: datetime) -> None:
        ranks = self._runs.get(run_key)
        if ranks is None:
            self._runs[run_key] = {rank: ts}
            return
        previous = ranks.get(rank)
        if previous is None or ts > previous:  # (a step read late does not move the rank back)
            ranks[rank] = ts

    def forget(self, run_key: str) -> None:
        self._runs.pop(run_key, None)

    def __len__(self) -> int:
        return len(self._runs)

    def export(self, max_ranks: int = MAX_RANKS_PER_RUN) -> dict[str, dict[int, float]]:
        """run id -> rank -> seconds since the epoch, at most ``max_ranks`` ranks per run (the most behind
        when it has more). A split run's groups (their own keys) come back under the run's id."""
        merged: dict[str, dict[int, datetime]] = {}
        for key, ranks in self._runs.items():
            merged.setdefault(parse_key(key)[0], {}).update(_most_behind(ranks, max_ranks))
        return {
            run_id: {rank: ts.timestamp() for rank, ts in _most_behind(ranks, max_ranks).items()}
            for run_id, ranks in merged.items()  # (a split run's groups together: the cap is the run's)
        }


def _most_behind(ranks: dict[int, datetime], limit: int) -> dict[int, datetime]:
    if len(ranks) <= limit:
        return ranks
    return dict(heapq.nsmallest(limit, ranks.items(), key=lambda item: item[1]))
