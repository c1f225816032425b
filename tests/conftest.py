"""Suite-wide: a RunWatch that cannot reach its broker spools to disk under $RUNWATCH_SPOOL_DIR
(default ./.runwatch/spool); point that at a temporary directory so tests never leave spools in
the working tree, nor replay one left by an earlier test run."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from runwatch.producer.publish.kafka_delivery import SPOOL_DIR_ENV


@pytest.fixture(scope="session", autouse=True)
def _spool_in_a_temporary_directory(tmp_path_factory) -> Iterator[None]:
    before = os.environ.get(SPOOL_DIR_ENV)
    os.environ[SPOOL_DIR_ENV] = str(tmp_path_factory.mktemp("spool"))
    yield
    if before is None:
        os.environ.pop(SPOOL_DIR_ENV, None)
    else:
        os.environ[SPOOL_DIR_ENV] = before
