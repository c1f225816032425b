"""Stage one of a split run (issue 36): one rank group's monitor.

A ``GroupMonitor`` is a ``RunMonitor`` over the ranks of one group: every rank's own detectors, the
group's liveness (stall, hung rank) and its cross-rank comparison (straggler), and the join of its ranks'
steps. It decides nothing: what it finds, each step it joins (as a ``StepPartial``) and its ranks'
run-level events (run_start, eval, checkpoint, action_ack, run_end) go into its output's ``report``, which
the worker signs and sends to the worker of the run's own key. There a ``RunMergeMonitor`` merges the
groups, judges the run's joined step, and runs the policy once for the whole run, so one fault gives one
action whichever groups saw it.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime

import orjson

from runwatch.contract.group_report import ReportItem
from runwatch.contract.groups import group_ranks
from runwatch.contract.schema import Anomaly, CheckpointEvent, RunStartEvent, TelemetryEvent
from runwatch.detectors.config import RunwatchConfig
from runwatch.detectors.engine.monitor import MonitorOutput, RunMonitor
from runwatch.detectors.engine.rank_join import Joined
from runwatch.detectors.engine.step_partial import partial_of
from runwatch.detectors.findings import Finding

# The kinds the run's own monitor needs: what the run is (rank 0's run_start and run_end), its evaluations,
# its checkpoints (rollback targets) and its ranks' acknowledgements of actions.
RUN_LEVEL_KINDS = frozenset({"run_start", "eval", "checkpoint", "action_ack", "run_end"})


def _for_the_run(event: TelemetryEvent) -> bool:
    """Whether the run's own monitor is to see ``event``: the first rank of every group says when its group
    starts and ends (its worker sees no other rank's), the run's own start and end are rank 0's."""
    if event.kind not in RUN_LEVEL_KINDS:
        return False
    return event.rank == 0 or event.kind not in ("run_start", "run_end")


class GroupMonitor(RunMonitor):
    """One rank group of a split run (see the module doc). ``shape``: (group size, world size), which every
    event of the group must repeat (the processor dead-letters one that disagrees)."""

    def __init__(self, run_id: str, config: RunwatchConfig, group: int, group_size: int, world_size: int):
        super().__init__(run_id, config)
        self.group = group
        self.shape = (group_size, world_size)
        self.join.set_ranks(group_ranks(group, group_size, world_size))
        self.joined_detectors = []  # the run's: judged where the groups are merged
        self.reports_sent = 0

    def observe(self, event: TelemetryEvent) -> MonitorOutput:
        seen = self.events_seen
        out = super().observe(event)
        if self.events_seen > seen and _for_the_run(event):  # (not a redelivered one)
            # first: what the event led to here (a rank detector's finding at run_end) comes after it
            out.report.insert(0, ReportItem.model_construct(event=orjson.loads(event.to_json())))
        return out

    def _on_run_start(self, event: RunStartEvent, out: MonitorOutput) -> None:
        # (not the join's world size: this join is of the group's ranks)
        self.started, self.attempt = True, event.attempt

    def _on_checkpoint(self, event: CheckpointEvent, out: MonitorOutput) -> None:
        # No checkpoint ledger and no rewind snapshots here: the run's monitor keeps the ledger (it decides
        # the rollbacks) and rewinds the run's detectors. A copy of every rank's detectors per checkpoint
        # would make a group's snapshot several times its live state (issue 36: at most 1 MiB); after a
        # rollback the ranks' own detectors judge the replay as they are.
        self._to_rank(event, out)

    def _observe_joined(self, joined: Joined, out: MonitorOutput) -> None:
        partial = joined.partial
        if partial is None:  # (a group of one rank: its step is that rank's)
            partial = partial_of((joined.generation, joined.event.step), [joined.event], 1, [])
        out.report.append(ReportItem.model_construct(partial=partial))
        if joined.record is not None:
            for detector in self.cross_rank_detectors:
                for finding in detector.update(joined.record, joined.event.ts):
                    self._emit(finding, joined.event.ts, joined.event.event_id, out)

    def _emit(self, finding: Finding, ts: datetime, cause: str, out: MonitorOutput) -> Anomaly | None:
        out.report.append(ReportItem.model_construct(finding=asdict(finding), finding_ts=ts, cause=cause))
        return None
