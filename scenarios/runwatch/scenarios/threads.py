"""Train a tiny model on one torch thread, and give the process its thread count back after.

Torch runs on a thread per core by default. For the small tensors of the scenarios, the demo and
the tests, one thread is fastest and steady: beside two CPU-bound processes on two cores, a 3 ms
step took 40-60 ms at its 90th percentile with the default pool, 7 ms with one thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
