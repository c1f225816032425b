"""The one cooldown every detector uses: quiet for a number of steps after a finding.

A finding at step ``s`` quiets ``[s + 1, s + steps]``. Steps at or before ``s`` are outside it:
after a rollback the trainer replays steps from an earlier checkpoint, and a fault that comes back
there must be found again, not muted by the cooldown of its first finding. (The monitor also
rewinds the detectors' state to the restored checkpoint where it has a snapshot, ``engine/rewind.py``;
this keeps a detector right where it has none.) ``module_grad`` keeps one cooldown per module in
numpy arrays with the same window.
"""

from __future__ import annotations


class Cooldown:
    __slots__ = ("quiet_from", "quiet_until")

    def __init__(self) -> None:
        self.quiet_from = 0
        self.quiet_until = -1

    def start(self, step: int, steps: int) -> None:
        """A finding at ``step``: quiet for the ``steps`` steps after it."""
        self.quiet_from, self.quiet_until = step + 1, step + steps

    def active(self, step: int) -> bool:
        return self.quiet_from <= step <= self.quiet_until
