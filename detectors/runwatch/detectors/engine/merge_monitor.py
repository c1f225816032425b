"""Stage two of a split run (issue 36): the run's own monitor, fed by its rank groups' reports.

A ``RunMergeMonitor`` is a ``RunMonitor`` that sees no rank's events: each group's report (group_monitor.py)
brings the group's joined steps as partials, merged here across the groups (group_join.py) into the run's
joined step, which the run-level detectors judge as they judge any run's; the groups' findings, issued here
through the one policy of the run (so a NaN seen by one rank's detector and by the joined loss is one
rollback); and the run-level events of the groups' ranks (run_start, eval, checkpoint, action_ack, run_end),
observed as a run that is not split observes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import orjson
from pydantic import TypeAdapter

from runwatch.contract.group_report import ReportBody
from runwatch.contract.schema import ActionAckEvent, TelemetryEvent, WireFloat, decode_event
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.group_join import GroupJoin
from runwatch.detectors.engine.group_monitor import RUN_LEVEL_KINDS
from runwatch.detectors.engine.monitor import MonitorOutput, RunMonitor
from runwatch.detectors.findings import Finding

_FINDING_FLOATS = ("value", "threshold", "score")
_wire_float: TypeAdapter[float | None] = TypeAdapter(WireFloat | None)  # (the wire's "NaN" strings)


def finding_from(fields: dict[str, Any]) -> Finding:
    """A group's finding as its report carried it (a NaN value travels as the string "NaN")."""
    known = {name: fields[name] for name in Finding.__dataclass_fields__ if name in fields}
    for name in _FINDING_FLOATS:
        if isinstance(known.get(name), str):
            known[name] = _wire_float.validate_python(known[name])
    return Finding(**known)


class RunMergeMonitor(RunMonitor):
    """A split run's own monitor (see the module doc). ``shape``: (group size, world size), which every
    report must repeat."""

    def __init__(self, run_id: str, config: RunwatchConfig, group_size: int, world_size: int):
        super().__init__(run_id, config)
        self.shape = (group_size, world_size)
        self.join.set_world_size(world_size)
        self.groups = GroupJoin(run_id, config.join.timeout_s)
        self.groups.set_shape(world_size, group_size)
        self.cross_rank_detectors = []  # (the groups compare their ranks)

    def observe_report(self, group: int, body: ReportBody, at: datetime) -> MonitorOutput:
        """One group's report, its items in order."""
        out = MonitorOutput()
        self.groups.counts(group, body.late, body.duplicates)
        for item in body.items:
            if item.event is not None:
                event = decode_event(orjson.dumps(item.event))
                if event.kind not in RUN_LEVEL_KINDS:
                    continue  # (a group forwards none: nothing of a rank's own is judged here)
                _extend(out, self.observe(event))
                continue
            own = MonitorOutput()
            if item.partial is not None:
                self.last_step = item.partial.step
                for joined in self.groups.add(group, item.partial):
                    self._observe_joined(joined, own)
            elif item.finding is not None:
                finding = finding_from(item.finding)
                # (a group's worker that restarts reports its replayed findings again: judged once)
                said = f"finding|{group}|{item.cause}|{finding.detector}|{finding.metric}|{finding.rank}"
                if not self._seen_before(said):
                    self._emit(finding, item.finding_ts or at, item.cause or "", own)
            self._await_acks(own, at)
            _extend(out, own)
        return out

    def _to_rank(self, event: Any, out: MonitorOutput, stale: bool = False) -> None:
        return  # (the groups judge their ranks)

    def _to_cross_rank(self, event: TelemetryEvent, out: MonitorOutput) -> None:
        return

    def _rollback_acknowledged(self, ack: ActionAckEvent) -> None:
        first = self._rewound_for != ack.action_id
        super()._rollback_acknowledged(ack)
        if first and self._rewound_for == ack.action_id and self._stale_through is None:
            # no rank's steps are joined here: the steps merged so far came before the rollback
            self._stale_through = self.groups._emitted

    def tick(self, now: datetime) -> MonitorOutput:
        out = MonitorOutput()
        for joined in self.groups.expire(now):
            self._observe_joined(joined, out)
        self._await_acks(out, now)
        _extend(out, super().tick(now))
        return out

    def finish(self) -> MonitorOutput:
        out = MonitorOutput()
        for joined in self.groups.flush():
            self._observe_joined(joined, out)
        return out


def _extend(out: MonitorOutput, more: MonitorOutput) -> None:
    out.anomalies += more.anomalies
    out.decisions += more.decisions
    out.joined += more.joined
    out.repeated += more.repeated
