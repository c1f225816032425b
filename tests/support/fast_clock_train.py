"""``fault_train.py`` on a host whose wall clock is ``$FAST_CLOCK_AHEAD_S`` seconds fast (issue 35, item 9).

Every wall-clock time runwatch's producer reads comes from ``schema.utc_now`` (event times, and so the
records' Kafka timestamps, and the listener's judgement of actions); this moves that clock, and
``time.time`` for the Kafka client, ahead before anything else runs. libfaketime would move the whole
process's clock, but under it (0.9.10, Python 3.11) ``threading.Event.wait`` never returns and
``time.sleep`` fails with EINVAL once the monotonic clock is left alone: a trainer's threads cannot run.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from datetime import timedelta
from pathlib import Path

import runwatch.contract.messages.base as schema  # where utc_now is defined (its globals)

AHEAD = timedelta(seconds=float(os.environ["FAST_CLOCK_AHEAD_S"]))
schema._test_clock_ahead = AHEAD  # type: ignore[attr-defined]


def _fast_utc_now():  # runs with schema's globals (datetime, UTC) once it is utc_now's code
    return datetime.now(UTC) + _test_clock_ahead  # type: ignore[name-defined]  # noqa: F821


# The function object itself is kept (models hold it as their default_factory); its code is replaced
schema.utc_now.__code__ = _fast_utc_now.__code__
_real_time = time.time
time.time = lambda: _real_time() + AHEAD.total_seconds()

script = Path(__file__).with_name("fault_train.py")
sys.argv = [str(script), *sys.argv[1:]]
runpy.run_path(str(script), run_name="__main__")
