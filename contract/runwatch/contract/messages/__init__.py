"""The wire messages, one module per family: the base every message shares (``base``), the events a
trainer sends (``run``, ``step``, ``heartbeat``, ``evidence``, ``crash``), their union (``telemetry``),
what the worker publishes (``worker``: findings, joined steps, actions) and the dead letters
(``dead_letter``). ``runwatch.contract.schema`` hands every name on from one place."""
