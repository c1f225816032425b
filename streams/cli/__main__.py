"""``python -m runwatch.streams.cli``: the ``runwatch`` command (the worker process is started this way)."""

from runwatch.streams.cli.main import main

main()
