"""Checkpoint key conventions of MoE families whose files name experts differently from the model.

In the model (transformers 5, after ``split_experts``) expert e of a block is
``<block>.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` and the block is ``mlp``. Most
families store exactly these names (Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4-MoE, OLMoE, ...). Mixtral
(and MiniMax, which follows it) store the block as ``block_sparse_moe`` and the expert linears as
``w1`` (gate), ``w3`` (up) and ``w2`` (down): that is what their checkpoints hold and what vLLM's
loaders read, so lowbit writes them that way and reads them back (``model_names``), as
transformers does when it loads them.

Both maps act on whole name components (``a.b.c``), never on substrings.

``FUSED_ON_DISK``: families whose checkpoints keep the experts fused, as the model holds them
(gpt-oss: ``<block>.experts.gate_up_proj`` [E, H, 2I] interleaved, ``down_proj`` [E, I, H], with
``gate_up_proj_bias`` / ``down_proj_bias``), and their layout; model-free quantization splits
them per expert (``lowbit.moe.slices``) and writes ``<block>.experts.{e}.gate_proj.weight`` ...,
the names lowbit writes from memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.moe.slices import FusedLayout


@dataclass(frozen=True)
class KeyConvention:
    block: str                      # the MoE block's name component on disk ("block_sparse_moe")
    linears: tuple[tuple[str, str], ...]  # (model name, disk name) of an expert's linears


_MIXTRAL = KeyConvention("block_sparse_moe", (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")))
CONVENTIONS: dict[str, KeyConvention] = {"mixtral": _MIXTRAL, "minimax": _MIXTRAL}
FUSED_ON_DISK: dict[str, FusedLayout] = {"gpt_oss": FusedLayout(transposed=True, concatenated=False)}
FUSED_WEIGHTS = ("gate_up_proj", "down_proj")            # <block>.experts.<leaf>, 3-D
FUSED_BIASES = ("gate_up_proj_bias", "down_proj_bias")   # <block>.experts.<leaf>, 2-D


def _convert(key: str, conv: KeyConvention, to_disk: bool) -> str:
    parts = key.split(".")
    src_block, dst_block = ("mlp", conv.block) if to_disk else (conv.block, "mlp")
    lin = dict(conv.linears) if to_disk else {d: m for m, d in conv.linears}
    for i in range(len(parts) - 1):
        if parts[i] == src_block and i >= 2 and parts[i - 2] == "layers":
            parts[i] = dst_block
            # <block>.experts.<e>.<linear>
            if i + 3 < len(parts) and parts[i + 1] == "experts" and parts[i + 2].isdigit() and parts[i + 3] in lin:
                parts[i + 3] = lin[parts[i + 3]]
            break
    return ".".join(parts)


def checkpoint_names(model_type: str | None, keys: list[str]) -> dict[str, str]:
    """model key -> the key the family's checkpoints use (identity for most families)."""
    conv = CONVENTIONS.get(model_type or "")
    return {k: (k if conv is None else _convert(k, conv, True)) for k in keys}


def model_names(model_type: str | None, keys: list[str]) -> dict[str, str]:
    """checkpoint key -> the model key (the inverse of ``checkpoint_names``)."""
    conv = CONVENTIONS.get(model_type or "")
    return {k: (k if conv is None else _convert(k, conv, False)) for k in keys}
