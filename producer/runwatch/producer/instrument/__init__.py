"""torch instrumentation: the ``Watcher`` (watch.py) that fills each step event, and what it
measures with: gradient, parameter and update norms (gradstats.py), one packed copy per step
(step_packing.py), step time, throughput and MFU (runtime.py), memory (memory.py), heartbeats
(heartbeat.py), DDP sync timing (ddp_timing.py) and per-category loss (categories.py)."""
