import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import tiny_models directly


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: extra intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
