"""A model that prepares its weights in place in its first forward (RWKV's rescaling) is prepared
before a checkpoint is read into it (lowbit.checkpoint.prepare)."""

from __future__ import annotations

import copy
import warnings

import torch

import lowbit
from helpers.families import tiny_config, tiny_model
from lowbit.checkpoint.prepare import prepares_in_forward


def test_which_models_prepare_is_read_from_a_forward_on_the_meta_device():
    assert prepares_in_forward(tiny_config("rwkv"))
    assert not prepares_in_forward(tiny_config("llama"))


def test_rwkv_quantized_reloads_exactly(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("rwkv")
        model.config.rescale_every = 1  # layer 1's weights are halved by the first forward: visible
        ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits
        q = lowbit.quantize(copy.deepcopy(model), "w8a8-int8", calibration=ids, batch_size=2)
        with torch.no_grad():
            got = q(input_ids=ids, use_cache=False).logits
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 0.15, err
        for fmt in ("lowbit", "compressed-tensors"):
            back = lowbit.load(lowbit.save(q, tmp_path / fmt, format=fmt))
            assert back.rwkv.layers_are_rescaled
            with torch.no_grad():
                assert torch.equal(back(input_ids=ids, use_cache=False).logits, got), fmt
