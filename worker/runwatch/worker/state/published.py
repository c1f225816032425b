"""What a predecessor already published for the runs a worker restores: not to be published twice.

A run's snapshot is sent right after the findings and actions that prompted it, but the two are not
one write. A worker killed after its action reached the broker and before the snapshot did leaves a
successor that restores the snapshot before it, replays the events since, and decides the same action
again: same id, same content. So, once runs are restored, the successor reads the tail of the anomaly
and action topics and remembers what was published for those runs; a record decided again that is
identical to one already there (its id and content; not when it was made) is not sent again. A record
with a known id and other content is sent: that is the monitor updating a finding.

The tail is ``TAIL_RECORDS`` per partition: the record in question was published moments before the
takeover, so it is among the last ones unless findings of other runs flood its partition meanwhile.
The read has ``READ_BUDGET_S``: it comes after the state read, inside the same reply to the worker
(whose timeout fails the worker), so a slow one is logged and what was read by then is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeAlias

from runwatch.contract import topics
from runwatch.contract.schema import Action, Anomaly
from runwatch.worker.state.reader import StateReadError

if TYPE_CHECKING:
    # StateReader.scan: (topic, partitions, tail, timeout_s) -> every record's (key, value)
    _Scan: TypeAlias = Callable[
        [str, Iterable[int] | None, int | None, float | None], Iterator[tuple[bytes | None, bytes | None]]
    ]

log = logging.getLogger(__name__)

TAIL_RECORDS = 5000
READ_BUDGET_S = 5.0

# Fields set when a record is made, not decided: a decision made again differs only in these.
_ANOMALY_MADE = {"detected_at"}
_ACTION_MADE = {"issued_at", "expires_at", "signature"}


class Published:
    """The anomalies and actions already on the topics for restored runs, by run and id."""

    def __init__(self) -> None:
        self._runs: dict[str, dict[tuple[str, str], str]] = {}  # run -> (kind, id) -> content

    def __len__(self) -> int:
        return sum(len(seen) for seen in self._runs.values())

    def __bool__(self) -> bool:  # (checked per event: O(1), not a count)
        return bool(self._runs)

    def add(self, record: Anomaly | Action) -> None:
        self._runs.setdefault(record.run_id, {})[_key(record)] = _content(record)

    def update(self, other: Published) -> None:
        for run_id, seen in other._runs.items():
            self._runs.setdefault(run_id, {}).update(seen)

    def is_repeat(self, record: Anomaly | Action) -> bool:
        """Already published, as it is now (but for when it was made)."""
        seen = self._runs.get(record.run_id)
        return seen is not None and seen.get(_key(record)) == _content(record)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)


def _key(record: Anomaly | Action) -> tuple[str, str]:
    return ("anomaly", record.anomaly_id) if isinstance(record, Anomaly) else ("action", record.action_id)


def _content(record: Anomaly | Action) -> str:
    return record.model_dump_json(exclude=_ANOMALY_MADE if isinstance(record, Anomaly) else _ACTION_MADE)


def read_published(
    scan: _Scan,
    run_ids: Iterable[str],
    tail: int = TAIL_RECORDS,
    budget_s: float = READ_BUDGET_S,
) -> Published:
    """``scan(topic, partitions, tail, timeout_s)``: a StateReader's. Records that do not parse are
    skipped."""
    wanted = {run.encode() for run in run_ids}
    published = Published()
    if not wanted:
        return published
    models: tuple[tuple[str, type[Anomaly] | type[Action]], ...] = (
        (topics.ANOMALIES, Anomaly),
        (topics.ACTIONS, Action),
    )
    for topic, model in models:
        try:
            for key, value in scan(topic, None, tail, budget_s):
                if key not in wanted or value is None:
                    continue
                try:
                    published.add(model.model_validate_json(value))
                except ValueError:
                    continue
        except StateReadError as exc:
            log.warning(
                "%s: what the restored runs' previous worker published after their last snapshots may "
                "be issued again (%s)",
                topic,
                exc,
            )
    return published
