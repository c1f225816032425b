"""The wire contract, importable alone: the message schema, topic names and consumer-group ids,
and action signing. Loads pydantic and orjson only: never the publisher, the watcher, the
action listener, torch, Kafka, Faust, river or ClickHouse.
"""
