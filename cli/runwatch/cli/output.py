"""How commands print JSON (``--json`` and the reports): one encoder for all, indented, numpy-aware."""

from __future__ import annotations

import sys
from typing import Any


def print_json(obj: Any) -> None:
    """Write ``obj`` to stdout as indented JSON (orjson: datetimes as ISO 8601, numpy arrays as lists)."""
    import orjson

    sys.stdout.write(
        orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode() + "\n"
    )
