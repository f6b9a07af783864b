"""How a tokenizer starts a text: the BOS token it puts in front by default, if any.

A model sees its training text the way its tokenizer encodes a text by default. Gemma's and
Llama 3's tokenizers put a BOS token first (``tokenizer("x")["input_ids"][0] ==
bos_token_id``) and those models expect it; SmolLM2's adds nothing. lowbit tokenizes
evaluation and calibration text once, without special tokens, and cuts it into windows, so
each window (each perplexity window, each last-word context, each calibration window) is
started with the id returned here, and only the text tokens after it are scored.
"""

from __future__ import annotations

import torch

_PROBE = "The"  # any short text: only the first id of its two encodings is compared


def bos_to_prepend(tokenizer) -> int | None:
    """The BOS id that ``tokenizer`` puts before a text by default, or None.

    It is ``tokenizer.bos_token_id`` when the default encoding of a probe text starts with it
    and the encoding without special tokens does not; None otherwise (no BOS token, a tokenizer
    that does not add it, or a plain callable that takes no ``add_special_tokens``)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        with_special = list(tokenizer(_PROBE)["input_ids"])
        without = list(tokenizer(_PROBE, add_special_tokens=False)["input_ids"])
    except (TypeError, KeyError, IndexError):
        return None
    if with_special[:1] == [bos] and without[:1] != [bos]:
        return int(bos)
    return None


def prepend(ids: torch.Tensor, bos: int | None) -> torch.Tensor:
    """``ids`` [..., T] with ``bos`` put in front along the last dim (unchanged when None)."""
    if bos is None:
        return ids
    start = torch.full((*ids.shape[:-1], 1), bos, dtype=ids.dtype, device=ids.device)
    return torch.cat([start, ids], dim=-1)
