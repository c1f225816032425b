"""Compatibility shim: the wire schema lives in ``runwatch.producer.wire.schema``."""

from runwatch.producer.wire.schema import *  # noqa: F403
