"""Child processes that do not outlive the process that started them (Linux): ``runwatch up`` killed
with SIGKILL, or crashing, must not leave its broker and worker running on their own."""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when its parent dies; None where the
    kernel has no such thing (then a killed parent leaves its children, as before)."""
    if not sys.platform.startswith("linux"):
        return None

    def arrange() -> None:  # runs in the child, between fork and exec
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return arrange
