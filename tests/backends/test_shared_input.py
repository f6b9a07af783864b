"""Sibling linears share one quantized input: same outputs, no stale values, nothing kept alive."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from lowbit.backends import use_backend
from lowbit.backends.cpu_int8 import CpuInt8Backend
from lowbit.backends.reference import ReferenceBackend
from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.backends.weight_cache import WeightCacheBackend
from lowbit.calibration import input_scales_from_amax
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme


def _linear(scheme: str, out_f: int, amax: float = 3.0, name: str = "l", seed: int = 0) -> QuantLinear:
    torch.manual_seed(seed)
    s = get_scheme(scheme)
    kw = {}
    if s.input_activations.needs_calibration:
        kw = input_scales_from_amax(s.input_activations, torch.tensor([amax]))
    return QuantLinear.from_linear(nn.Linear(64, out_f), s, name=name, **kw)


BACKENDS = [("w8a8-int8", CpuInt8Backend, "int8"), ("w8a8-int8-dynamic", CpuInt8Backend, "int8"),
            ("nvfp4", WeightCacheBackend, "qdq"), ("mxfp8", WeightCacheBackend, "qdq"),
            ("nvfp4-e5m3", WeightCacheBackend, "qdq"), ("w8a8-fp8", WeightCacheBackend, "qdq")]


def _alone(backend_cls, m, x):
    return backend_cls().forward(m, x)  # a fresh instance: nothing shared


@pytest.mark.parametrize("scheme,backend_cls,quantity", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_siblings_reuse_and_match_unshared(scheme, backend_cls, quantity):
    q, k = _linear(scheme, 32, name="q", seed=1), _linear(scheme, 16, name="k", seed=2)
    be = backend_cls()
    x = torch.randn(2, 5, 64)
    yq = be.forward(q, x)
    cached = be.shared.lookup(x, input_key(q, quantity))
    assert cached is not None
    yk = be.forward(k, x)
    assert be.shared.lookup(x, input_key(k, quantity)) is cached          # k reused q's input
    assert torch.equal(yq, _alone(backend_cls, q, x)) and torch.equal(yk, _alone(backend_cls, k, x))
    torch.testing.assert_close(yk, ReferenceBackend().forward(k, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,backend_cls,quantity", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_inplace_change_and_other_scales_are_not_hits(scheme, backend_cls, quantity):
    q = _linear(scheme, 32, name="q")
    other = _linear(scheme, 16, amax=0.5, name="o")   # a different static scale (same for dynamic specs)
    be = backend_cls()
    x = torch.randn(4, 64)
    be.forward(q, x)
    assert torch.equal(be.forward(other, x), _alone(backend_cls, other, x))
    x.mul_(3.0)                                        # in place: the version changes
    assert be.shared.lookup(x, input_key(q, quantity)) is None
    assert torch.equal(be.forward(q, x), _alone(backend_cls, q, x))
    x[0, :8] = 100.0                                   # through an indexing view
    assert torch.equal(be.forward(q, x), _alone(backend_cls, q, x))
    view = x.view(2, 2, 64)                            # another tensor object: computed afresh
    assert torch.equal(be.forward(q, view), _alone(backend_cls, q, view))


def test_entry_is_dropped_when_the_input_is_freed():
    m = _linear("mxfp8", 32)
    be = WeightCacheBackend()
    x = torch.randn(8, 64)
    be.forward(m, x)
    assert len(be.shared) == 1
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None and len(be.shared) == 0       # neither the input nor its QDQ is kept


def test_shared_input_unit():
    cache = SharedInput()
    calls = []

    def compute(v):
        calls.append(v)
        return v

    x = torch.ones(3)
    assert cache.get(x, "a", lambda: compute(1)) == 1
    assert cache.get(x, "a", lambda: compute(2)) == 1 and calls == [1]
    assert cache.get(x, "b", lambda: compute(3)) == 3                 # another key
    assert cache.get(torch.ones(3), "b", lambda: compute(4)) == 4     # another tensor
    with torch.inference_mode():
        y = torch.ones(3)
        assert cache.get(y, "a", lambda: compute(5)) == 5
        assert cache.get(y, "a", lambda: compute(6)) == 6             # inference tensors are never shared
    assert len(copy.deepcopy(cache)) == 0


def test_use_backend_shares_one_instance_per_backend():
    model = nn.Sequential(_linear("w8a8-int8", 64, name="a"), _linear("w8a8-int8", 64, name="b"),
                          _linear("mxfp8", 64, name="c"))
    assert use_backend(model, "auto") == {"cpu-int8": 2, "weight-cache": 1}
    assert model[0].backend is model[1].backend and model[2].backend is not model[0].backend
    model2 = nn.Sequential(_linear("w8a8-int8", 64, name="a"))
    use_backend(model2, "auto")
    assert model2[0].backend is not model[0].backend                  # per use_backend call, no global state
