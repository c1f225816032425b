"""Comparing a run with the history of its job: the baseline side of runwatch (issue 14).

``compare``: a run's summary metrics against the runs of the same baseline key and hardware
fingerprint, with robust statistics and distinct verdicts. Pure; the history is handed in.
"""
