"""Which checkpoints a rollback may restore: only *confirmed-good* ones.

A checkpoint is registered *pending*. It becomes *good* once the run has gone ``confirm_steps``
steps past it with no finding of a detector that can trigger a rollback (and no rollback's
recovery still unverified). Such a finding rejects every pending checkpoint (they did not get
their healthy steps) and every good one that may hold the fault: one taken at or after the step
whose update caused the onset.

Which step caused an onset. Loss, grad norm, update ratio, module grads and non-finite values are
seen *after* an update: the loss of step ``s`` is computed with the weights that step ``s - 1``'s
update produced, so the update that caused an onset at ``s`` is step ``s - 1``'s, and a checkpoint
saved at step ``s - 1`` (after its update) already holds it. The rollback target is therefore the
newest good checkpoint strictly before ``onset - 1``. Every detector is treated this way: for the
few that see the data of the step itself (a category's loss, a data wait) this is one step more
cautious than needed.

Pure and picklable: the monitor feeds it joined steps, checkpoints, findings and rollbacks.
"""

from __future__ import annotations

from runwatch.contract.schema import CheckpointRef


class CheckpointLedger:
    def __init__(self, confirm_steps: int):
        self.confirm_steps = confirm_steps
        self.pending: list[CheckpointRef] = []
        self.good: list[CheckpointRef] = []
        self.rejected = 0  # how many were never confirmed, or demoted

    def register(self, ref: CheckpointRef) -> None:
        """A checkpoint saved (``ok``); one at the same step (a replay after a rollback) replaces it."""
        self.pending = [c for c in self.pending if c.step != ref.step] + [ref]
        self.good = [c for c in self.good if c.step != ref.step]

    def observe_step(self, step: int, hold: bool = False) -> list[CheckpointRef]:
        """The run reached ``step`` (joined); returns the checkpoints confirmed now. ``hold``: a
        rollback's recovery is not verified yet, so nothing is confirmed."""
        if hold or not self.pending:
            return []
        confirmed = [c for c in self.pending if step >= c.step + self.confirm_steps]
        if confirmed:
            self.pending = [c for c in self.pending if c not in confirmed]
            self.good = sorted(self.good + confirmed, key=lambda c: c.step)
        return confirmed

    def reject_for(self, onset_step: int | None) -> None:
        """A finding that can trigger a rollback, with its onset: pending checkpoints never become
        good, and good ones at or after the step that caused the onset are no longer good."""
        self.rejected += len(self.pending)
        self.pending = []
        if onset_step is not None:
            keep = [c for c in self.good if c.step < onset_step - 1]
            self.rejected += len(self.good) - len(keep)
            self.good = keep

    def target(self, onset_step: int | None) -> CheckpointRef | None:
        """The newest good checkpoint from before the update that caused ``onset_step``."""
        earlier = [c for c in self.good if onset_step is None or c.step < onset_step - 1]
        return earlier[-1] if earlier else None

    def rolled_back(self, to_step: int) -> None:
        """The run restored ``to_step``: checkpoints after it belong to the abandoned timeline."""
        self.pending = [c for c in self.pending if c.step <= to_step]
        self.good = [c for c in self.good if c.step <= to_step]
