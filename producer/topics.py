"""Compatibility shim: topic names and group ids live in ``runwatch.producer.wire.topics``."""

from runwatch.producer.wire.topics import *  # noqa: F403
