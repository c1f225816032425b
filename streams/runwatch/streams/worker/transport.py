"""Faust's aiokafka transport with a short consumer fetch wait.

faust-streaming 0.15 builds the worker's consumer with ``fetch_max_wait_ms=1500`` and no
setting to change it. A broker that holds a fetch until that wait runs out (Tansu does, when
fewer than ``fetch_min_bytes`` are ready) then delays every event by up to 1.5 s, which is the
floor on detection latency. This transport is the same in every other respect; the worker uses
it through the ``runwatch://`` broker URL scheme.
"""

from __future__ import annotations

import os
from typing import Any

from faust.transport.drivers import TRANSPORTS
from faust.transport.drivers import aiokafka as faust_aiokafka

FETCH_MAX_WAIT_MS = int(os.environ.get("RUNWATCH_FETCH_MAX_WAIT_MS", "50"))
SCHEME = "runwatch"


class LowLatencyConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # aiokafka reads this when start() builds its fetcher, after construction.
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class Consumer(faust_aiokafka.Consumer):
    def _new_consumer_thread(self) -> LowLatencyConsumerThread:
        return LowLatencyConsumerThread(self, loop=self.loop, beacon=self.beacon)


class Transport(faust_aiokafka.Transport):
    Consumer = Consumer


TRANSPORTS.aliases.setdefault(SCHEME, f"{__name__}:Transport")
