"""The detection worker (``runwatch worker``): the Faust app and its transport, the per-message processor,
the detector child process, the run lifecycle and budget, health, metrics and OTLP export, and the runs'
state snapshots (``state/``)."""
