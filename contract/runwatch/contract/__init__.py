"""The wire contract, a room of its own: the message schema and its decoding, topic names and
consumer-group ids, limits, action kinds, action signing and the inbox that verifies what arrives.

What the producer, the worker, the sink and the remediator agree on, importable without any of them.
Loads pydantic, orjson and cryptography only: never the publisher, the watcher, the action listener,
torch, Kafka, Faust, river or ClickHouse.
"""
