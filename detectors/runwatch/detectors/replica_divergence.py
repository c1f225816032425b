"""Replicas whose parameters no longer agree: silent data corruption (issue 38).

Data-parallel replicas hold bit-identical parameters. Every ``fingerprint_every`` steps each replica sends
an exact digest of its parameters' bits (``param_digest``, producer/runwatch/producer/instrument/
fingerprint.py); the join groups a step's digests by value (``replicas``). All equal: the replicas agree,
and the step is remembered as the last one known good. More than one digest: a critical finding. The
largest group is taken to be right when it holds more than half of the digests; the others' ranks are
named ("rank 1's parameters differ from the other 3 replicas'"). Without a majority (two replicas, or a
split down the middle) every group's ranks are named and none is called right. Its onset is the step
after the last one on which every replica agreed, so a rollback rule for this detector restores a
checkpoint from before the corruption. One finding per episode: the replicas must agree again before
another.

Replicas that are not bit-identical by design (ranks of a sharded model, FSDP or ZeRO; runs that average
parameters every few steps rather than gradients every step) send no digest: the producer sends one only
for a ``DistributedDataParallel`` model or with ``rw.watch(replicas=True)``.
"""

from __future__ import annotations

from datetime import datetime

from runwatch.contract.schema import DigestGroup, StepEvent, TelemetryEvent
from runwatch.detectors.base import Detector
from runwatch.detectors.findings import Finding
from runwatch.detectors.registry import DetectorSpec, Strict, register


class ReplicaDivergenceConfig(Strict):
    """Data-parallel replicas whose parameter digests disagree (silent data corruption): the rank named."""

    enabled: bool = True


NAME = "replica_divergence"


class ReplicaDivergenceDetector(Detector):
    name = NAME

    def __init__(self, config: ReplicaDivergenceConfig):
        self.config = config
        self.last_agreed: int | None = None  # the last step on which every replica's digest was the same
        self.diverged = False  # within an episode of disagreement (found once)

    def update(self, event: TelemetryEvent, now: datetime) -> list[Finding]:
        if not isinstance(event, StepEvent) or event.replicas is None:
            return []
        groups = event.replicas.groups
        total = sum(g.count for g in groups) + event.replicas.other
        if total < 2:
            return []
        if len(groups) == 1 and event.replicas.other == 0:
            self.last_agreed, self.diverged = event.step, False
            return []
        if self.diverged:
            return []
        self.diverged = True
        return [self._finding(event, groups, total)]

    def _finding(self, event: StepEvent, groups: list[DigestGroup], total: int) -> Finding:
        largest = max(groups, key=lambda g: g.count)
        majority = largest if 2 * largest.count > total else None
        odd = [g for g in groups if g is not majority]
        odd_ranks = sorted(r for g in odd for r in g.ranks)
        odd_count = total - (majority.count if majority is not None else 0)
        named = ", ".join(str(r) for r in odd_ranks) + ("..." if len(odd_ranks) < odd_count else "")
        since = (
            f"all {total} equal at step {self.last_agreed}"
            if self.last_agreed is not None
            else "never compared equal"
        )
        if majority is not None:
            who = f"rank {named}'s" if odd_count == 1 else f"ranks {named}'"
            message = (
                f"{who} parameters differ from the other {majority.count} replicas' at step {event.step} "
                f"({since}): silent data corruption or an update of its own"
            )
        else:
            message = (
                f"the {total} replicas' parameters fall into {len(groups)} groups with no majority at step "
                f"{event.step} ({since}): ranks {named} disagree"
            )
        rank = odd_ranks[0] if majority is not None and odd_count == 1 and odd_ranks else None
        evidence: dict[str, object] = {
            "kind": "replica_divergence",
            "ranks": odd_ranks,
            "disagreeing": odd_count,
            "agreeing": majority.count if majority is not None else 0,
            "groups": [{"digest": g.digest, "count": g.count, "ranks": g.ranks} for g in groups],
            "last_agreed_step": self.last_agreed,
        }
        if rank is not None:
            evidence["rank"] = rank
        if self.last_agreed is not None:
            evidence["onset_step"] = self.last_agreed + 1
        return Finding(
            detector=NAME,
            metric="param_digest",
            step=event.step,
            rank=rank,
            severity="critical",
            value=float(odd_count),
            threshold=0.0,
            score=float(odd_count),
            message=message,
            evidence=evidence,
            onset_step=self.last_agreed + 1 if self.last_agreed is not None else None,
        )


register(
    DetectorSpec(
        name=NAME,
        config=ReplicaDivergenceConfig,
        build=lambda d: ReplicaDivergenceDetector(d.replica_divergence),
        view="joined",
        summary="data-parallel replicas whose parameter digests disagree (silent data corruption), named",
        faults=(),
    )
)
