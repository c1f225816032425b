"""The parts of the worker's per-message logic (``runwatch.worker.processor.TelemetryProcessor``), one
layer each: the runs held and let go (held_runs.py), what a run's monitor says made into findings, signed
actions and dead letters (outputs.py), the runs' durable state (durable_state.py); the results' types in
results.py. Free of Faust, like the processor."""
