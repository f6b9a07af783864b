"""Linears outside the decoder layers on a run that cannot run the whole model after the layers
(streamed: ``lowbit.calibration.outside``): calibrated on their inputs before the first layer, or
quantized from their weights when their scheme needs no inputs; one the model calls only after the
layers is refused, naming it."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama
from lowbit.calibration import CalibrationConfig
from lowbit.calibration.hooks import InMemory
from lowbit.calibration.pipeline import LayerwiseCalibrator
from lowbit.errors import QuantizationError
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme
from lowbit.targets import quantizable_linears


class _LayerAtATime(InMemory):
    whole_model = False


def _run(scheme: str, hooks: InMemory, **cfg):
    model = tiny_llama(tie_word_embeddings=False)
    names = quantizable_linears(model, [], True)  # lm_head too: it runs after the decoder layers
    tokens = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    cfg = CalibrationConfig(num_samples=4, seq_len=16, batch_size=2, **cfg)
    LayerwiseCalibrator(model, get_scheme(scheme), cfg, None).run(tokens, names, hooks=hooks)
    return model


def test_a_linear_after_the_layers_is_refused_when_it_needs_inputs():
    with pytest.raises(QuantizationError, match=r"linear 'lm_head' is outside the decoder layers and gets no input "
                                                r"before the first of them"):
        _run("w8a8-int8", _LayerAtATime())
    assert isinstance(_run("w8a8-int8", InMemory()).lm_head, QuantLinear)  # the control: in memory it runs


def test_a_linear_whose_scheme_needs_no_inputs_is_quantized_from_its_weight():
    a, b = _run("w4a16", _LayerAtATime(), weight_rounding="rtn"), _run("w4a16", InMemory(), weight_rounding="rtn")
    assert isinstance(a.lm_head, QuantLinear)
    assert torch.equal(a.lm_head.weight_codes, b.lm_head.weight_codes)
