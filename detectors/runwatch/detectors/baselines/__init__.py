"""Comparing a run with the history of its job: the baseline side of runwatch (issue 14).

``compare``: a run's summary metrics against the runs of the same baseline key and hardware
fingerprint, with robust statistics and distinct verdicts. Pure; the history is handed in.
``check``: the CI gate's judgement of one run (its history, verdicts, last normal run) and its reports.
``changepoints``: E-divisive change points over a metric's history, mapped onto runs and commits.
"""
