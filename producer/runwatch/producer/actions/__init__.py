"""The trainer's side of the action topic, one module per job.

- ``inbox``: what a raw message must pass before anyone acts on it (decode, run, signature,
  freshness, repeats); shared with the remediator, so it loads nothing of the training side.
- ``reader``: the listener's consumer thread: every partition of ``runwatch.actions``, no group,
  from the listener's start time.
- ``arrivals``: the accepted actions waiting for the loop's next ``poll``, in arrival order.
- ``applied_ids``: the ids a rank acknowledged, kept in a per-rank file across restarts.
- ``apply``: rollback (restore, LR scale, data window to skip), pause, resume, stop, alert, and the acks.
- ``rank_sync``: rank 0 announces what every rank applies at a poll (torch.distributed).
- ``watchdog``: the hard exit after a stop.
- ``listener``: ``ActionListener``, which puts them together for the training loop.

Import the modules themselves (the public names are ``runwatch.producer``'s): this file loads
none of them, so importing the inbox never loads the listener, the publisher or torch.
"""
