"""tests/support/fault_train.py, unchanged, with two clocks added for `make deploy-check`: when the NaN
batch is made (``--fault nan:S``) and when the trainer applies a rollback (the step boundary where its
ActionListener hands it over). Same arguments as fault_train.py; besides its result.json, ``--out`` gets
timings.json: ``{"nan_at": epoch s, "rollbacks": [{"at": epoch s, "step": S, "to_step": T}, ...]}``."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def main() -> int:
    spec = importlib.util.spec_from_file_location("fault_train", REPO / "tests/support/fault_train.py")
    assert spec is not None and spec.loader is not None
    trainer: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    args = trainer.parse()
    kind, _, at = args.fault.partition(":")
    nan_step = int(at) if kind == "nan" and at else None
    timings: dict[str, Any] = {"nan_at": None, "rollbacks": []}

    make_batch = trainer.batch

    def batch(batch_id: int, *a: Any, **kw: Any) -> Any:
        if batch_id == nan_step and timings["nan_at"] is None:  # the first pass only: the NaN is made once
            timings["nan_at"] = time.time()
        return make_batch(batch_id, *a, **kw)

    class TimedListener(trainer.ActionListener):  # type: ignore[misc]
        def poll(self, step: int) -> list[Any]:
            applied = list(super().poll(step))
            for a in applied:
                if a.kind == "rollback" and a.outcome == "applied":
                    timings["rollbacks"].append({"at": time.time(), "step": step, "to_step": a.to_step})
            return applied

    trainer.batch = batch
    trainer.ActionListener = TimedListener
    try:
        return int(trainer.main())
    finally:
        (args.out / "timings.json").write_text(json.dumps(timings))


if __name__ == "__main__":
    sys.exit(main())
