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

Mixture-of-experts layers (``expand_for_layer``): a mapping onto the MLP's gate/up projections
becomes a mapping onto every expert's gate/up (``mlp.experts.{e}``), the shared experts' and,
as *float targets*, the routers fed by the same norm (their weight columns are multiplied by s
too, so routing is unchanged; they take no part in choosing s). The up -> down mapping becomes
one mapping per expert whose output is linear in up (``GateKind.ACT_MUL``; not gpt-oss's clamped
SwiGLU).
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
    float_targets: tuple[str, ...] = ()  # modules with a weight rescaled but not quantized (routers)

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

_DEEPSEEK = (  # MLA: q_a_proj (q_proj without q_lora_rank) and kv_a_proj_with_mqa read the norm
    SmoothMapping("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), SourceKind.RMS),
    SmoothMapping("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), SourceKind.RMS),
    SmoothMapping("self_attn.q_a_layernorm", ("self_attn.q_b_proj",), SourceKind.RMS),
    SmoothMapping("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",), SourceKind.RMS),
    *_LLAMA[1:],
)

MAPPINGS: dict[str, tuple[SmoothMapping, ...]] = {
    "llama": _LLAMA,
    "qwen2_moe": _LLAMA,
    "qwen3_moe": _LLAMA,
    "mixtral": _LLAMA,
    "gpt_oss": _LLAMA,
    "deepseek_v3": _DEEPSEEK,
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


def _dense_mlps(block, skip: set[str]) -> list[str]:
    """Children of an MoE block that are gated MLPs of their own (shared experts)."""
    out = []
    for name, child in block.named_children():
        if name not in skip and hasattr(child, "gate_proj") and hasattr(child, "up_proj") and hasattr(child, "down_proj"):
            out.append(name)
    return out


def expand_for_layer(maps: tuple[SmoothMapping, ...], layer) -> tuple[SmoothMapping, ...]:
    """``maps`` with the MLP mappings of an MoE layer expanded onto its experts (module docstring);
    dense layers get ``maps`` unchanged."""
    from lowbit.moe import GateKind, SplitExperts, router_names

    out: list[SmoothMapping] = []
    for m in maps:
        block_name = m.targets[0].rpartition(".")[0]
        try:
            block = layer.get_submodule(block_name) if block_name else None
        except AttributeError:
            block = None
        experts = getattr(block, "experts", None)
        if not isinstance(experts, SplitExperts):
            out.append(m)
            continue
        shared = _dense_mlps(block, {"experts"})
        routers = tuple(f"{block_name}.{n}" for n in router_names(block))
        if m.kind is SourceKind.LINEAR:  # up -> down, per expert and per shared expert
            for e in range(len(experts)):
                if experts[e].gate.kind is GateKind.ACT_MUL:
                    p = f"{block_name}.experts.{e}"
                    out.append(SmoothMapping(f"{p}.up_proj", (f"{p}.down_proj",), SourceKind.LINEAR))
            out += [SmoothMapping(f"{block_name}.{c}.up_proj", (f"{block_name}.{c}.down_proj",), SourceKind.LINEAR)
                    for c in shared]
            continue
        targets = []
        for e in range(len(experts)):
            p = f"{block_name}.experts.{e}"
            targets += ([f"{p}.gate_proj"] if experts[e].gate_proj is not None else []) + [f"{p}.up_proj"]
        for c in shared:
            targets += [f"{block_name}.{c}.gate_proj", f"{block_name}.{c}.up_proj"]
        out.append(SmoothMapping(m.source, tuple(targets), m.kind, float_targets=routers))
    return tuple(out)
