"""one_torch_thread pins torch to one thread and gives the caller its own count back, even on error."""

from __future__ import annotations

import pytest
import torch

from runwatch.scenarios.threads import one_torch_thread


def test_one_thread_inside_and_the_callers_count_restored_after_an_error() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError), one_torch_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("training failed")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
