"""The workers' run state: snapshots (``snapshot``: the signed record format; ``classes``: what a snapshot
may name), when they are taken (``run_states``), reading them back (``reader``, ``restore_progress``), and
what a predecessor already published (``published``)."""
