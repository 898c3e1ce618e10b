"""Fixtures shared by the test modules."""

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models run faster on one torch thread (and do not compete with parallel test processes)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
