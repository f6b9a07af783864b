"""Shared fixtures (the helpers they use live in tests/helpers, importable as ``helpers``)."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama


@pytest.fixture
def llama():
    return tiny_llama()


@pytest.fixture
def token_ids():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 24), generator=g)


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) of the built-in SmolLM2-135M in float32, loaded once per module."""
    from lowbit.models import load_model

    return load_model(None)
