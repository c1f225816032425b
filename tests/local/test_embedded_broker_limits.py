"""The embedded broker's limits, as docs/embedded-broker.md states them (measured on Tansu 0.6.0).

If one of these starts failing, Tansu changed: update docs/embedded-broker.md (and
``committed_offset`` in local/runwatch/local/broker.py, which works around the wrong latest offset).
"""

from __future__ import annotations

import time
import uuid

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic

from runwatch.contract import topics
from runwatch.local.broker import EmbeddedBroker, ensure_topics

pytestmark = pytest.mark.integration

API = topics.KAFKA_API_VERSION


def test_latest_offset_is_the_last_batchs_base_offset_plus_one(broker):
    topic = f"latest-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, api_version=API)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    tp = TopicPartition(topic, 0)
    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=API, linger_ms=1000)
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap, api_version=API, fetch_max_wait_ms=50)
    try:
        assert producer.send(topic, partition=0, value=b"alone").get(10).offset == 0  # a batch of one
        assert consumer.end_offsets([tp])[tp] == 1  # right: one record, next offset 1
        batch = [producer.send(topic, partition=0, value=b"%d" % i) for i in range(9)]  # one batch of nine
        producer.flush()
        assert [f.get(10).offset for f in batch] == list(range(1, 10))  # acknowledged: offsets 1..9
        # Kafka would answer 10 (the next offset). Tansu answers the last batch's base offset + 1.
        assert consumer.end_offsets([tp])[tp] == 2

        # So a consumer that starts at "latest" re-reads the rest of that batch: 8 records sent before it.
        consumer.assign([tp])
        consumer.seek_to_end(tp)
        assert consumer.position(tp) == 2
        seen: list[int] = []
        deadline = time.monotonic() + 10
        while len(seen) < 8 and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=100).values():
                seen.extend(r.offset for r in records)
        assert seen == list(range(2, 10))
    finally:
        producer.close()
        consumer.close()


def test_a_restart_loses_every_topic_and_record(tmp_path):
    embedded = EmbeddedBroker(log_path=tmp_path / "broker.log").start()
    try:
        ensure_topics(embedded.bootstrap)
        producer = KafkaProducer(bootstrap_servers=embedded.bootstrap, api_version=API)
        acked = [producer.send(topics.TELEMETRY, key=b"run-1", value=b"{}").get(10) for _ in range(6)]
        producer.close()
        assert len(acked) == 6
        embedded.stop()
        embedded.start()  # the same port
        admin = KafkaAdminClient(bootstrap_servers=embedded.bootstrap, api_version=API)
        try:
            assert not set(topics.ALL_TOPICS) & set(admin.list_topics())  # the topics are gone
        finally:
            admin.close()
        ensure_topics(embedded.bootstrap)
        consumer = KafkaConsumer(bootstrap_servers=embedded.bootstrap, api_version=API)
        try:
            tps = [
                TopicPartition(topics.TELEMETRY, p) for p in consumer.partitions_for_topic(topics.TELEMETRY)
            ]
            assert sum(consumer.end_offsets(tps).values()) == 0  # and so are the 6 acknowledged records
        finally:
            consumer.close()
    finally:
        embedded.stop()
