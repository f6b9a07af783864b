"""ModuleCache: one rule for what backends derive from a layer's weight."""

from __future__ import annotations

import copy
import gc

import torch
import torch.nn as nn

from lowbit.backends.cache import ModuleCache, weight_stamp
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme


def _layer():
    return QuantLinear.from_linear(nn.Linear(32, 8), get_scheme("w8a16"), name="t")


def test_built_once_per_weight_state():
    m, cache, calls = _layer(), ModuleCache(), []
    build = lambda mod: calls.append(1) or mod.dequantized_weight()  # noqa: E731
    a = cache.get(m, build)
    assert cache.get(m, build) is a and len(calls) == 1
    m.weight_scale.mul_(2)                      # in place: the version counter moves
    b = cache.get(m, build)
    assert len(calls) == 2 and torch.equal(b, 2 * a)
    m.weight_codes = m.weight_codes.clone()     # a new tensor: the storage moves
    cache.get(m, build)
    assert len(calls) == 3


def test_never_keeps_a_layer_alive_and_copies_empty():
    m, cache = _layer(), ModuleCache()
    cache.get(m, lambda mod: mod.dequantized_weight())
    assert m in cache and len(copy.deepcopy(cache)) == 0
    stamp = weight_stamp(m)
    assert len(stamp) == 4 and stamp[2] is None  # no zero point on a symmetric scheme
    del m
    gc.collect()
    assert len(cache) == 0
