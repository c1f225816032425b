"""torch instrumentation: the ``Watcher`` (watch.py) that fills each step event, its options
(watch_options.py), and what it measures with: gradient, parameter and update norms (gradstats.py),
one packed copy per step (step_packing.py) and the step event it becomes (pending_steps.py), the
guard's skips (guard.py, update_guard.py), step time, throughput and MFU (runtime.py), off-step phases
(off_step.py), an optimizer that stopped stepping (optimizer_stepping.py), memory (memory.py),
heartbeats (heartbeat.py), DDP sync timing (ddp_timing.py) and per-category loss (categories.py)."""
