"""One torch compute thread for a block of a test: processes a test starts (rank workers, forked engines)
take the parent's thread count, and tiny models' ops gain nothing from more threads on a shared CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread in this process while the block runs; the previous count restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
