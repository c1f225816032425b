"""The labelled corpus: every recorded scenario trained into ``<name>.jsonl``, and ``labels.json``."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from runwatch.scenarios.catalog import CORPUS, DETECTOR_FOR, SCENARIOS
from runwatch.scenarios.clocks import START, SimulatedClock
from runwatch.scenarios.scenario import Scenario
from runwatch.scenarios.training import ScenarioOutcome, run_scenario


def label_for(sc: Scenario, outcome: ScenarioOutcome) -> dict[str, Any]:
    label: dict[str, Any] = {
        "name": sc.name,
        "fault": sc.fault,
        "expected_detector": DETECTOR_FOR.get(sc.fault),
        "onset_step": outcome.onset_step,
        "onset_ts": outcome.onset_ts.isoformat() if outcome.onset_ts else None,
        "model": sc.model,
        "steps": outcome.steps,
        "status": outcome.status,
        "description": sc.description,
        "benign": list(sc.benign),
        "seed": sc.seed,
        **sc.injector.label_fields(),
    }
    label.update({k: v for k, v in outcome.notes.items() if v is not None})
    return label


def generate(
    out_dir: Any,
    names: list[str] | None = None,
    *,
    quick: bool = False,
    progress: Callable[[str, dict[str, Any], float], None] | None = None,
) -> list[dict[str, Any]]:
    """Record the chosen scenarios (default: the whole corpus) into ``out_dir``;
    returns the labels written."""
    from runwatch.producer.publish.recorder import JsonlRecorder

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [SCENARIOS[n] for n in names] if names else list(CORPUS)
    labels = []
    for sc in chosen:
        started = time.perf_counter()
        clock = SimulatedClock(start=START - timedelta(days=sc.days_earlier))
        rec = JsonlRecorder(
            out / f"{sc.name}.jsonl",
            f"scenario-{sc.name}",
            clock=clock.now,
            collect_metadata=False,
            seed=sc.seed,
            config=recorded_config(sc, quick),
            tags={
                "scenario": sc.name,
                "fault": sc.fault,
                "model": sc.model,
                "memory_model": "emulated-caching-allocator",
            },
            baseline_key=sc.job,
        )
        outcome = run_scenario(sc, rec, clock, quick=quick)
        rec.close(status=outcome.status, summary={"steps": outcome.steps})
        label = label_for(sc, outcome)
        labels.append(label)
        if progress is not None:
            progress(sc.name, label, time.perf_counter() - started)
    (out / "labels.json").write_text(json.dumps(labels, indent=2) + "\n")
    return labels


def recorded_config(sc: Scenario, quick: bool) -> dict[str, Any]:
    """The scenario as its run_start's ``config``: every training parameter and the fault's figures."""
    fault = sc.injector.describe()
    magnitude = fault["magnitude"]
    return {
        "name": sc.name,
        "fault": sc.fault,
        "model": sc.model,
        "steps": sc.n_steps(quick),
        "quick_steps": sc.quick_steps,
        "onset": sc.onset,
        "batch": sc.batch,
        "lr": sc.lr,
        "schedule": sc.schedule,
        "warmup": sc.warmup,
        "step_time_s": sc.step_time_s,
        "data_wait_s": sc.data_wait_s,
        "noise": sc.noise,
        "checkpoint_every": sc.checkpoint_every,
        "checkpoint_s": sc.checkpoint_s,
        "eval_every": sc.eval_every,
        "eval_s": sc.eval_s,
        "module": fault["module"],
        "category": fault["category"],
        "kind": fault["kind"],
        "magnitude": magnitude if magnitude is None or math.isfinite(magnitude) else str(magnitude),
        "seed": sc.seed,
        "extra": dict(sc.extra),
    }
