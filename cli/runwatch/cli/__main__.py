"""``python -m runwatch.cli``: the ``runwatch`` command (the worker process is started this way)."""

from runwatch.cli.main import main

main()
