"""What drives the detectors for one run: the monitor (events in, findings and actions out), the
per-step join across ranks, every rank's progress, the action policy, confirmed checkpoints, the
recovery check after a rollback and the detectors' snapshots for rewinding them.

Nothing is imported here: detectors import ``engine.progress``, and the monitor imports every
detector, so the modules are imported by name.
"""
