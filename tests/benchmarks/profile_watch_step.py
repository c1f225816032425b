"""Where runwatch's host time per step goes: inclusive thread-CPU time per step of its functions.

watch_host_cost.py's loop (the 150-tensor model, a broker started here), with each function listed below
wrapped in a timer of the calling thread's CPU clock: a wrapper per call, not a tracer, so the figures
are not inflated the way cProfile's are for small calls (a few tenths of a microsecond per wrapped call).
Inclusive: a caller's figure holds its callees'. Prints one line per function, most expensive first; the
background threads' CPU is watch_host_cost.py's ``background_by_thread_us``. docs/profiles/trainer.md has
the figures and how to read them. Not part of the test suite.

    .venv/bin/python tests/benchmarks/profile_watch_step.py [STEPS]
"""

from __future__ import annotations

import collections
import importlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from watch_host_cost import tiny_model

from runwatch.local.broker import EmbeddedBroker, ensure_topics
from runwatch.producer import RunWatch

# (module, class or None, function names): what is timed, where it exists in the version on PYTHONPATH
# (issue 41 moved some of the watcher's into modules of their own: an earlier version lacks those)
TIMED = (
    (
        "runwatch.producer.instrument.watch",
        "Watcher",
        "before_optimizer_step after_optimizer_step end_step _end_step _ship _publish _pack_norms _judge "
        "_optimizer_not_stepping _add_rates _take_off_step_time _current_lr",
    ),
    ("runwatch.producer.instrument.pending_steps", "PendingSteps", "ship publish"),
    ("runwatch.producer.instrument.update_guard", "UpdateGuard", "judge"),
    ("runwatch.producer.instrument.optimizer_stepping", "OptimizerStepping", "not_stepping"),
    ("runwatch.producer.instrument.off_step", "OffStepTime", "take"),
    ("runwatch.producer.instrument.gradstats", "ParamLayout", "grads per_tensor_norms module_sums scale_"),
    ("runwatch.producer.instrument.step_packing", "StepPacking", "pack unpack"),
    ("runwatch.producer.instrument.memory", "MemorySampler", "sample"),
    ("runwatch.producer.instrument.runtime", "StepClock", "lap"),
    ("runwatch.producer.instrument.heartbeat", "Heartbeat", "set_step"),
    ("runwatch.producer.publish.run_watch", "RunWatch", "step queue_step publish"),
    ("runwatch.producer.publish.events", "RunEvents", "build pending"),
    ("runwatch.producer.publish.kafka_delivery", "KafkaDelivery", "deliver deliver_later"),
)

spent: collections.Counter[str] = collections.Counter()


def _wrap(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time_ns()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.thread_time_ns() - t

    setattr(owner, name, timed)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for module_name, class_name, names in TIMED:
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except ModuleNotFoundError:
            continue
        for name in names.split():
            if hasattr(owner, name):
                _wrap(owner, name, f"{class_name}.{name}")
    with EmbeddedBroker() as broker:
        ensure_topics(broker.bootstrap)
        model = tiny_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(4, 16)
        with tempfile.TemporaryDirectory() as spool:
            rw = RunWatch(f"profile-{time.time_ns()}", broker.bootstrap, spool_dir=spool)
            watch = rw.watch(model, opt, clip=1.0, update_every=10, heartbeat_s=5.0)
            for i in range(50 + steps):
                if i == 50:
                    spent.clear()  # (after the warm-up)
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                watch.end_step(loss, samples=4)
                opt.zero_grad(set_to_none=True)
            rw.close(timeout=10)
    for label, ns in spent.most_common():
        print(f"{label:40s} {ns / steps / 1000:8.1f} us/step")


if __name__ == "__main__":
    main()
