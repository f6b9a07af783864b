"""The linears a model's forward sets apart, for model-free quantization, which reads no forward.

In memory, one forward of the model decides which linears are not quantized although they are
``nn.Linear`` (``lowbit.targets.survey_weights``): those whose weight the forward reads without
calling them (Mamba's ``dt_proj``, used as ``dt_proj.weight``), routers found by their top-k, and
linears whose outputs weight hidden vectors (Gemma 3n's AltUp coefficients). Model-free
quantization has the checkpoint's tensors and config.json only; the same forward is run here on
the model transformers builds from that config on the meta device (no memory, no weights, its
fused experts split as in memory, ``lowbit.linearize``), on 8 token ids on the meta device, and
followed by the same tracer (``lowbit.param_uses.trace_call``): the decision is the in-memory one,
read from the same code. A model whose forward cannot run on the meta device (data-dependent
control flow, such as a ``tolist()`` of routing counts) sets nothing apart, and its linears are
quantized by name, as before (``set_apart`` returns None then, so the caller can say so).
"""

from __future__ import annotations

import hashlib
import warnings
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn


def set_apart(folder: str | Path) -> tuple[str, ...] | None:
    """The model names of the linears the forward of the model ``folder``'s config.json describes
    sets apart (module docstring), in model order; None when that forward cannot be followed on
    the meta device."""
    text = (Path(folder) / "config.json").read_bytes()
    return _set_apart(str(folder), hashlib.sha256(text).hexdigest())


@lru_cache(maxsize=8)
def _set_apart(folder: str, _config_digest: str) -> tuple[str, ...] | None:
    from lowbit.param_uses import trace_call

    try:
        from transformers import AutoConfig

        from lowbit.linearize import linearize
        from lowbit.meta_model import meta_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = AutoConfig.from_pretrained(folder)
            model = meta_model(cfg)
            linearize(model)
    except Exception:  # noqa: BLE001 - a config transformers cannot build: nothing is known
        return None
    vocab = int(getattr(cfg, "vocab_size", None) or 32)
    ids = (torch.arange(8) % max(vocab - 1, 1) + 1).reshape(1, -1).to("meta")
    emb = model.get_input_embeddings()
    hidden = emb.embedding_dim if isinstance(emb, nn.Embedding) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = trace_call(model, {}, lambda: model(input_ids=ids, use_cache=False), hidden)
    if tr is None:
        return None
    heads = {n for n, m in model.named_modules() if m is model.get_output_embeddings()}
    return tuple(n for n in tr.read_directly + tr.routers + tr.coefficients if n not in heads)
