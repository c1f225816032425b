"""``LocalStack``: everything ``runwatch up`` runs on one machine, started in order and stopped in
reverse, with nothing stored lost on the way down.

Started: the embedded broker (unless a bootstrap is given), the worker (a child process, its files in
the state folder), the sink consumer (a thread of this process, which owns the store: the embedded
engine admits one process), the local page on that store (sinks/page/), and the remediator when
given its config. Stopped: the worker first (it commits what it judged), then the sink drains every
topic to its end, then the page, the remediator, the store and the broker.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.local.secret import StackActionKeys, stack_action_keys, stack_state_secret
from runwatch.local.state_lock import hold
from runwatch.local.worker_process import WorkerProcess, wait_until

if TYPE_CHECKING:
    from runwatch.contract.signing import ActionPublicKeys
    from runwatch.detectors.config import RunwatchConfig
    from runwatch.sinks.clickhouse import ClickHouseSink
    from runwatch.sinks.consumer import SinkConsumer
    from runwatch.sinks.page import PageServer
    from runwatch.sinks.remediate.consumer import RemediateConsumer

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 30.0
STOP_BUDGET_S = 15.0  # the drain's wait aside: joining the sink's and the remediator's threads


@dataclass
class StackOptions:
    state_dir: Path = Path(".runwatch")
    bootstrap: str | None = None  # an existing Kafka; None: the embedded broker
    dsn: str | None = None  # an existing ClickHouse; None: the embedded store in state_dir/clickhouse
    config_path: Path | None = None  # the workers' YAML (also the sink's limits and the page's baseline)
    remediate_config: Path | None = None  # runs the remediator with it
    page_host: str = "127.0.0.1"
    page_port: int = 8750  # 0: a free one
    worker_ready_s: float = 180.0


@dataclass
class LocalStack:
    options: StackOptions
    say: Callable[[str], None] = print
    broker: EmbeddedBroker | None = None
    bootstrap: str = ""
    action_keys: StackActionKeys | None = None  # the worker's signing key; the public key for everyone else
    state_secret: str = ""  # the worker's alone: signs its state snapshots (never in .runwatch/env)
    worker: WorkerProcess | None = None
    sink: ClickHouseSink | None = None
    sink_consumer: SinkConsumer | None = None
    page: PageServer | None = None
    remediator: RemediateConsumer | None = None
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: IO[str] | None = None

    @property
    def logs(self) -> Path:
        return (self.options.state_dir / "logs").resolve()

    # -- up ----------------------------------------------------------------------------------------

    def start(self) -> LocalStack:
        """Start every part; on a failure, stop what started and raise."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        from runwatch.detectors.config import RunwatchConfig, load_config

        opts = self.options
        config = load_config(opts.config_path) if opts.config_path else RunwatchConfig()
        _check_port(opts.page_host, opts.page_port)  # before anything starts: a busy port is one line
        self._lock = hold(opts.state_dir)  # (one stack per state folder; made 0700)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.action_keys = keys = stack_action_keys(opts.state_dir)
        self.state_secret = stack_state_secret(opts.state_dir, keys.seed)
        self._start_broker()
        self.worker = WorkerProcess(
            self.bootstrap,
            keys.signing_key,
            self.logs / "worker.log",
            opts.config_path,
            die_with_parent=True,
            state_secret=self.state_secret,
        )
        self.say(f"worker starting (log: {self.worker.log_path})")
        self._start_store(config)
        if opts.remediate_config is not None:
            self._start_remediator(opts.remediate_config)
        self.worker.wait_ready(opts.worker_ready_s)

    def _start_broker(self) -> None:
        if self.options.bootstrap:
            self.bootstrap = self.options.bootstrap
        else:
            self.broker = EmbeddedBroker(log_path=self.logs / "broker.log", die_with_parent=True).start()
            self.bootstrap = self.broker.bootstrap
        ensure_topics(self.bootstrap)

    def _start_store(self, config: RunwatchConfig) -> None:
        from runwatch.sinks.clickhouse import ClickHouseSink
        from runwatch.sinks.consumer import SinkConsumer
        from runwatch.sinks.page import PageServer

        dsn = self.options.dsn or f"chdb://{(self.options.state_dir / 'clickhouse').resolve()}"
        self.sink = ClickHouseSink(dsn)
        self.sink.migrate()
        self.sink_consumer = SinkConsumer(
            self.sink,
            self.bootstrap,
            batch_interval_s=0.5,
            limits=config.limits,
            summary_loss_every=config.baseline.loss_every,
            public_keys=self._public_keys(),
            # (the embedded broker's topics are made here, with the default count; a given Kafka's are
            # not known here, and the worker dead-letters a record on the wrong partition anyway)
            partitions=topics.DEFAULT_PARTITIONS if self.broker is not None else None,
        )
        self._run_thread("runwatch-sink", self.sink_consumer.run)
        self.page = PageServer(
            self.sink, self.options.page_host, self.options.page_port, config.baseline
        ).start()

    def _start_remediator(self, path: Path) -> None:
        from runwatch.sinks.remediate.config import load_remediation_config
        from runwatch.sinks.remediate.consumer import RemediateConsumer
        from runwatch.sinks.remediate.record import RemediationStore

        assert self.sink is not None
        config = load_remediation_config(str(path))
        self.remediator = RemediateConsumer(
            config, self._public_keys(), RemediationStore(self.sink), self.bootstrap
        )
        self._run_thread("runwatch-remediate", self.remediator.run)

    def _public_keys(self) -> ActionPublicKeys:
        assert self.action_keys is not None
        return self.action_keys.public_keys

    def _run_thread(self, name: str, target: Callable[[], Any]) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def dead_part(self) -> str | None:
        """What has ended on its own, in one line (None: every part still runs). ``runwatch up`` asks this
        every half second: a stack with a part gone must say so, not keep serving a page of nothing."""
        if self.broker is not None and self.broker.process is not None:
            code = self.broker.process.poll()
            if code is not None:
                return (
                    f"the embedded broker exited with {code}: every event and offset it held is gone "
                    f"(in memory only; see {self.broker.log_path})"
                )
        if self.worker is not None and self.worker.process.poll() is not None:
            return f"the worker exited with {self.worker.process.returncode}; see {self.worker.log_path}"
        for thread in self._threads:
            if not thread.is_alive():
                return f"the {thread.name.removeprefix('runwatch-')} stopped; see the messages above"
        return None

    # -- down --------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop in reverse order; the sink stores everything on the broker before it stops. Bounded
        (STOP_BUDGET_S and the parts' own timeouts) whatever has died: a broker gone is not drained, and
        a thread still waiting on it is left (a daemon: it ends with the process)."""
        broker_alive = self._broker_alive()
        if self.worker is not None:  # (with the broker gone it has nothing left to commit)
            self.worker.stop(timeout=20.0 if broker_alive else 5.0)
        deadline = time.monotonic() + STOP_BUDGET_S
        if self.sink_consumer is not None and self.bootstrap and broker_alive:
            self._drain()
        for consumer in (self.sink_consumer, self.remediator):
            if consumer is not None:
                consumer.stopping.set()
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("runwatch up: %s did not stop in time; leaving it", thread.name)
        if self.page is not None:
            self.page.stop()
        if self.sink is not None:
            self.sink.close()
        if self.broker is not None:
            self.broker.stop()
        if self._lock is not None:
            self._lock.close()  # (releases the state folder)
        self._lock = None
        self.worker = self.sink_consumer = self.remediator = self.page = self.sink = self.broker = None
        self._threads.clear()

    def _broker_alive(self) -> bool:
        return self.broker is None or (self.broker.process is not None and self.broker.process.poll() is None)

    def _drain(self) -> None:
        """Wait (bounded) until the sink has stored every record on the topics it copies."""
        assert self.sink_consumer is not None
        consumer = self.sink_consumer
        try:
            ends = end_offsets(self.bootstrap, topics.ALL_TOPICS)
        except Exception as exc:  # noqa: BLE001 - a broker already gone: nothing more to drain
            log.warning("runwatch up: could not read the topics' ends (%s): not draining", exc)
            return

        def stored() -> bool:
            return all(consumer.stored_through(t, p) >= end for (t, p), end in ends.items())

        try:
            wait_until(stored, DRAIN_TIMEOUT_S, "the sink to store every record", interval=0.2)
        except Exception as exc:  # noqa: BLE001 - say what was left, stop anyway
            left = {f"{t}[{p}]": end - consumer.stored_through(t, p) for (t, p), end in ends.items()}
            self.say(f"warning: {exc}; not stored: { ({k: n for k, n in left.items() if n > 0}) }")


def end_offsets(bootstrap: str, names: tuple[str, ...]) -> dict[tuple[str, int], int]:
    """The next offset of every partition of ``names``: what a caught-up consumer has read."""
    from kafka import KafkaConsumer, TopicPartition

    # (bounded: kafka-python's consumer waits up to 305 s for a broker that does not answer)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, request_timeout_ms=10_000
    )
    try:
        parts = [
            TopicPartition(name, p)
            for name in names
            for p in sorted(consumer.partitions_for_topic(name) or ())
        ]
        return {(tp.topic, tp.partition): int(end) for tp, end in consumer.end_offsets(parts).items()}
    finally:
        consumer.close()


def _check_port(host: str, port: int) -> None:
    """Raise ``OSError`` (EADDRINUSE) now when ``host:port`` cannot be listened on."""
    import socket

    if port == 0:
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the page's server does
        probe.bind((host, port))
