"""The layouts of the fused experts a checkpoint's model holds, read from the model itself.

    fused_layouts(folder)   # {experts module name: FusedLayout}

Model-free quantization reads no forward and builds no weights, but a checkpoint may store a
block's experts fused exactly as the model holds them: under the model's own name, or under one
transformers only renames when it loads it (Granite's ``block_sparse_moe.input_linear.weight``,
loaded as ``block_sparse_moe.experts.gate_up_proj``, ``lowbit.renames.load_names``). The layout of
such a tensor is then the one transformers' experts module declares (``is_transposed``,
``is_concatenated``, ``has_gate``: the flags ``lowbit.moe.split`` splits the module by in memory),
read here from the model transformers builds from ``config.json`` on the meta device (no memory,
no weights). A linear applied per input group (DeepSeek-V4's ``o_a_proj``, ``lowbit.moe.row_groups``)
has the layout ``FusedLayout(row_groups=G)``: its one stored weight holds group g as row block g;
weighted shared experts (Inkling's ``shared_experts``, ``lowbit.moe.weighted_shared``) the layout
``FusedLayout(separate=True)`` their split found: ``<module>.<proj>[e]`` is expert e's linear. A
config transformers cannot build gives no layout, and fused experts stay refused.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from lowbit.moe.row_groups import row_groups
from lowbit.moe.slices import FusedLayout
from lowbit.moe.split import is_fused_experts
from lowbit.moe.weighted_shared import weighted_layout


def fused_layouts(folder: str | Path) -> dict[str, FusedLayout]:
    """{name of each fused experts module (and linear applied per input group) of the model
    ``folder``'s config.json describes: its layout}."""
    text = (Path(folder) / "config.json").read_bytes()
    return dict(_layouts(str(folder), hashlib.sha256(text).hexdigest()))


@lru_cache(maxsize=8)
def _layouts(folder: str, _config_digest: str) -> tuple:
    try:
        from transformers import AutoConfig

        from lowbit.meta_model import meta_model

        model = meta_model(AutoConfig.from_pretrained(folder))
    except Exception:  # noqa: BLE001 - a config transformers cannot build: no layout is known
        return ()
    out = []
    for n, m in model.named_modules():
        if is_fused_experts(m):
            out.append((n, FusedLayout(transposed=m.is_transposed, concatenated=m.is_concatenated,
                                       has_gate=bool(getattr(m, "has_gate", True)))))
        elif groups := row_groups(m):
            out.append((n, FusedLayout(row_groups=groups)))
        elif (weighted := weighted_layout(m)) is not None:
            out.append((n, weighted))
    return tuple(out)
