"""Compatibility shim: action signing lives in ``runwatch.producer.wire.signing``."""

from runwatch.producer.wire.signing import *  # noqa: F403
