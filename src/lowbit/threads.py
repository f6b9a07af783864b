"""Torch's intra-op thread count, narrowed for a block of work."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one intra-op thread, restoring the caller's count afterwards.

    For work made of many small operations (GPTQ's column loop, model-free quantization's
    per-band scale rules and the tables built on first use), where waking a second thread costs
    more than it saves (bench/modelfree/RESULTS-modelfree.md, section 6)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
