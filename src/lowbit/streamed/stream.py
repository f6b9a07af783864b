"""``LayerStream``: the calibration hooks (``lowbit.calibration.hooks``) of a streamed run.

Before layer i is calibrated its tensors are read from the checkpoint (``Skeleton``) and, with a
``device``, moved there; while it computes, a background thread reads layer i + 1 (one layer
ahead, so at most two layers' float weights are in memory). After layer i is quantized its
shard and the resume state are written (``StreamOutput``) and the layer goes back to the meta
device. The embeddings (and whatever else lies outside the decoder layers) are read for the
capture of the first layer's inputs and released after it (``captured``), until the output's
last shard is written. Memory therefore holds one or two layers and the calibration
activations: it does not grow with the number of layers.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn

from lowbit.calibration.hooks import InMemory
from lowbit.streamed.output import StreamOutput
from lowbit.streamed.skeleton import Skeleton


def _rss_mb() -> float:
    """This process's resident set size now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; elsewhere nothing).
    A layer's weights are freed every step, but glibc keeps the freed middle-sized blocks of its
    arenas (one per thread: the prefetch thread has its own), so without this the resident size
    grows by a fraction of a layer per layer (measured: 685 -> 1238 MB over 5 layers of 25M
    parameters)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def release_freed_blocks(threshold: int = 1 << 20) -> bool:
    """Ask glibc to serve every block of ``threshold`` bytes or more by its own mapping, so a
    freed layer's tensors go straight back to the system (process-wide, until changed; its
    default threshold grows up to 32 MiB as blocks are freed, and freed blocks below it stay in
    the heap). ``lowbit quantize`` calls it for streamed runs: measured on the 0.68B model of
    bench/scale/RESULTS-scale.md, peak RSS 1340 -> 1028 MB. Returns whether it was set (glibc only)."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


class LayerStream(InMemory):
    whole_model = False  # one layer at a time: linears outside the layers are done first (calibration.outside)

    def __init__(self, skel: Skeleton, output: StreamOutput, device: torch.device | None = None,
                 offload: bool = False, prefetch: bool = True, log: bool = False) -> None:
        self.skel, self.output = skel, output
        self.device, self.offload = device, offload
        self.path = ""
        self.layers: nn.ModuleList | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lowbit-prefetch") if prefetch else None
        self._next: tuple[int, Future] | None = None
        self.log = log
        self.seconds: list[float] = []  # per layer: from enter to the end of leave
        self._t = 0.0

    def _prefix(self, i: int) -> str:
        return f"{self.path}.{i}"

    def _read(self, i: int) -> dict[str, torch.Tensor]:
        return self.skel.read_module(self.layers[i], self._prefix(i))

    def start(self, path: str, layers: nn.ModuleList) -> tuple[int, list[torch.Tensor] | None]:
        self.path, self.layers = path, layers
        self.skel.materialize_outside(path)
        first, saved = self.output.resume_point()
        if saved is not None and self.log:
            print(f"resuming at decoder layer {first} of {len(layers)}", file=sys.stderr)
        return first, saved

    def captured(self) -> None:
        self.skel.release_outside(self.path)
        trim_heap()

    def enter(self, i: int, layer: nn.Module) -> None:
        self._t = time.perf_counter()
        if self._next is not None and self._next[0] == i:
            state = self._next[1].result()
        else:
            state = self._read(i)
        self._next = None
        self.skel.assign(layer, state)
        del state
        if self.device is not None:
            layer.to(self.device)
        if self._pool is not None and i + 1 < len(self.layers):
            self._next = (i + 1, self._pool.submit(self._read, i + 1))

    def leave(self, i: int, layer: nn.Module, next_hidden: list[torch.Tensor] | None) -> None:
        self.output.write_layer(i, self.skel.model, layer, self._prefix(i), next_hidden)
        self.skel.release(layer)
        trim_heap()
        self.seconds.append(time.perf_counter() - self._t)
        if self.log:
            g = self.output.group
            rank = f"rank {g.rank}/{g.world}: " if g.distributed else ""
            print(f"{rank}layer {i + 1}/{len(self.layers)} in {self.seconds[-1]:.1f} s, resident "
                  f"{_rss_mb():.0f} MB", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._pool is not None:
            if self._next is not None:
                self._next[1].cancel()
            self._pool.shutdown(wait=True)
        self.skel.close()
