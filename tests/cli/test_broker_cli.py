"""`runwatch broker`: --port and a bootstrap (option or RUNWATCH_BOOTSTRAP) exclude each other,
loudly: the bootstrap used to win silently, and nothing listened on the port asked for."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from runwatch.cli.main import main
from runwatch.contract import topics
from runwatch.local import broker as broker_module


@pytest.fixture
def no_broker_side_effects(monkeypatch) -> list:
    """Record what the command would start or create, without a broker."""
    calls: list = []

    class FakeEmbedded:
        def __init__(self, port=None, **_):
            calls.append(("embedded", port))
            raise broker_module.BrokerError("not in a unit test")

    monkeypatch.setattr(broker_module, "EmbeddedBroker", FakeEmbedded)
    monkeypatch.setattr(
        broker_module,
        "ensure_topics",
        lambda bootstrap, partitions: calls.append(("ensure_topics", bootstrap)) or [],
    )
    return calls


def test_port_with_bootstrap_from_the_environment_is_an_error_that_says_which_wins(no_broker_side_effects):
    result = CliRunner().invoke(
        main, ["broker", "--port", "9092"], env={topics.BOOTSTRAP_ENV: "kafka-1:9092"}
    )
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--port 9092 starts an embedded broker" in message
    assert f"{topics.BOOTSTRAP_ENV}=kafka-1:9092 is set, which means: use that Kafka" in message
    assert f"unset {topics.BOOTSTRAP_ENV}" in message and "drop --port" in message
    assert no_broker_side_effects == []  # neither a broker started nor topics created


def test_port_with_bootstrap_option_is_an_error(no_broker_side_effects):
    result = CliRunner().invoke(
        main, ["broker", "--port", "9092", "--bootstrap", "kafka-1:9092"], env={topics.BOOTSTRAP_ENV: None}
    )
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert "--port 9092 starts an embedded broker, --bootstrap kafka-1:9092 uses an existing Kafka" in message
    assert no_broker_side_effects == []


def test_bootstrap_alone_creates_topics_there(no_broker_side_effects):
    result = CliRunner().invoke(main, ["broker"], env={topics.BOOTSTRAP_ENV: "kafka-1:9092"})
    assert result.exit_code == 0, result.output
    assert no_broker_side_effects == [("ensure_topics", "kafka-1:9092")]


def test_port_alone_starts_the_embedded_broker_on_it(no_broker_side_effects):
    result = CliRunner().invoke(main, ["broker", "--port", "9092"], env={topics.BOOTSTRAP_ENV: None})
    assert no_broker_side_effects == [("embedded", 9092)]
    assert result.exit_code == 2 and "not in a unit test" in result.output
