"""Which module feeds which linears, per architecture family (keyed by ``config.model_type``).

A mapping names, relative to one decoder layer, a *source* whose output channels are the
input channels of the *targets*, and how the source folds a per-channel division by s:

- RMS: ``y = norm(x) * w``                 -> w /= s          (Llama, Qwen2/3, Mistral)
- RMS_ONE_PLUS: ``y = norm(x) * (1 + w)``  -> w = (1 + w)/s - 1  (Gemma 1/2/3)
- LAYERNORM: ``y = norm(x) * w + b``       -> w /= s, b /= s  (OPT, GPT-2 style)
- LINEAR: a linear whose output rows are the channels (up_proj -> down_proj: the gated MLP
  is linear in up_proj; fc1 -> fc2 through ReLU, which commutes with a positive scale):
  rows of its weight and its bias /= s.

Targets' weight columns are multiplied by s. Nothing is left to multiply at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SourceKind(str, Enum):
    RMS = "rms"
    RMS_ONE_PLUS = "rms_one_plus"
    LAYERNORM = "layernorm"
    LINEAR = "linear"


@dataclass(frozen=True)
class SmoothMapping:
    source: str                 # module path relative to the decoder layer
    targets: tuple[str, ...]    # linear paths relative to the decoder layer
    kind: SourceKind

    @property
    def is_mlp_inner(self) -> bool:
        """up_proj -> down_proj style (a linear feeding a linear), optional."""
        return self.kind is SourceKind.LINEAR


_ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")

_LLAMA = (
    SmoothMapping("input_layernorm", _ATTN, SourceKind.RMS),
    SmoothMapping("post_attention_layernorm", _GATE_UP, SourceKind.RMS),
    SmoothMapping("mlp.up_proj", ("mlp.down_proj",), SourceKind.LINEAR),
)
_GEMMA = (
    SmoothMapping("input_layernorm", _ATTN, SourceKind.RMS_ONE_PLUS),
    SmoothMapping("pre_feedforward_layernorm", _GATE_UP, SourceKind.RMS_ONE_PLUS),
    SmoothMapping("mlp.up_proj", ("mlp.down_proj",), SourceKind.LINEAR),
)
_OPT = (
    SmoothMapping("self_attn_layer_norm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  SourceKind.LAYERNORM),
    SmoothMapping("final_layer_norm", ("fc1",), SourceKind.LAYERNORM),
    SmoothMapping("fc1", ("fc2",), SourceKind.LINEAR),
)

MAPPINGS: dict[str, tuple[SmoothMapping, ...]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,
    "gemma3_text": _GEMMA,
    "gemma3": _GEMMA,
    "opt": _OPT,
}


def model_type(model) -> str | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    text_cfg = getattr(cfg, "text_config", None)
    mt = getattr(cfg, "model_type", None)
    if mt not in MAPPINGS and text_cfg is not None:
        mt = getattr(text_cfg, "model_type", mt)
    return mt


def mappings_for(model, *, include_mlp_inner: bool = True) -> tuple[SmoothMapping, ...] | None:
    """The mappings of ``model``'s family, or None when the family is unknown."""
    maps = MAPPINGS.get(model_type(model) or "")
    if maps is None:
        return None
    return tuple(m for m in maps if include_mlp_inner or not m.is_mlp_inner)
