"""The local page: the process that owns the store (the sink of ``runwatch up`` or ``runwatch sink
--page``) serves the runs list and each run's report over HTTP while it writes, so that other commands
(``runwatch runs``, ``report``, ``baseline check``) read through it instead of opening an embedded store
that is locked by its owner (docs/local-stack.md)."""

from runwatch.sinks.page.client import PageClient, PageError, find_page
from runwatch.sinks.page.server import PageServer

__all__ = ["PageClient", "PageError", "PageServer", "find_page"]
