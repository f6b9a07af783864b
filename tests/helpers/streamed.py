"""Checkpoint folders for the streamed-path tests, and the in-memory result to compare against."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def write_folder(model, path: Path, dtype=torch.bfloat16, shard_bytes: str | int = "40KB", tokenizer=True) -> Path:
    """``model`` saved as a Hugging Face folder in ``dtype`` (several shards), with the byte
    tokenizer of the eval fixtures."""
    from helpers.eval_fixtures import byte_tokenizer

    model = model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(path, max_shard_size=shard_bytes)
    model.to(torch.float32)
    if tokenizer:
        byte_tokenizer().save_pretrained(path)
    return path


def in_memory(folder: Path, out: Path, scheme: str, fmt: str, tokens: torch.Tensor, **kw) -> Path:
    """The in-memory path on the same folder: load in float32, quantize, save (with the folder's
    tokenizer), as ``lowbit quantize`` does without streaming."""
    import lowbit

    model, tok = lowbit.load_model(folder)
    lowbit.quantize(model, scheme, calibration=tokens, tokenizer=tok, **kw)
    lowbit.save(model, out, format=fmt, tokenizer=tok, source_dir=folder)
    return out


def config_of(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())
