"""What the pipeline's two queues hold, per request (pipeline.py): the offsets of its events (None: the
timer's), its reply to come (then its records' deliveries, whether it is a checkpoint and its findings'
event times), the future it resolves. A leaf, so that the layers that name the queues (log_guard.py,
pipeline.py) do not import each other."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeAlias

from faust.types import RecordMetadata

from runwatch.worker import transport
from runwatch.worker.detector_process import Reply

Events: TypeAlias = list[transport.Settlement]
Inflight: TypeAlias = tuple[Events | None, Awaitable[Reply], asyncio.Future[bool] | None]
Delivered: TypeAlias = tuple[
    Events | None, list[Awaitable[RecordMetadata]], bool, asyncio.Future[bool] | None, list[float]
]
