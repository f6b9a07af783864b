"""Where the residual stream of a Hugging Face causal LM is read and written, for a fused rotation.

``residual_layout(model)`` returns the modules by full name: the input embedding, per decoder layer
the norms that read the stream with the linears (and routers) each one feeds, the linears that
write it, the v/o projections of attention, then the final norm and the output embedding. The
norm -> readers part is SmoothQuant's mapping table (``lowbit.algorithms.smoothquant.mappings``,
expanded onto MoE experts and routers by ``expand_for_layer``); the residual writers are the
attention output projection and the MLP's output projections (the targets of the up -> down
mappings: every expert's and shared expert's down_proj).

A fused rotation is exact only when nothing but those modules touches the stream, so anything
else is a QuantizationError naming the model class and the module:
- a family without a mapping (unknown structure);
- a norm of a kind that does not commute with a rotation once its gain is folded (LayerNorm's
  mean subtraction: OPT);
- a norm directly inside a decoder layer that reads no linear of the table (Gemma 2/3's
  post-attention / post-feedforward norms sit between o_proj/down_proj and the residual add);
- a weight matrix in a decoder layer that neither reads nor writes the stream by the table
  (e.g. gpt-oss's experts, whose clamped gating is not in the up -> down table);
- missing pieces: no base model with ``layers`` and ``norm``, no output embedding, no v_proj/o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.algorithms.smoothquant.mappings import SourceKind, expand_for_layer, mappings_for, model_type

FOLDABLE = (SourceKind.RMS, SourceKind.RMS_ONE_PLUS)
ATTN_V, ATTN_O = "self_attn.v_proj", "self_attn.o_proj"


@dataclass(frozen=True)
class NormReaders:
    norm: str                  # full module name
    kind: SourceKind           # RMS (y = rms(x) g) or RMS_ONE_PLUS (y = rms(x) (1 + g))
    readers: tuple[str, ...]   # modules with a weight [out, hidden] fed by the norm (linears, routers)


@dataclass(frozen=True)
class LayerParts:
    name: str
    norms: tuple[NormReaders, ...]
    writers: tuple[str, ...]   # linears whose outputs are added to the stream
    v_proj: str
    o_proj: str


@dataclass(frozen=True)
class ResidualLayout:
    embedding: str
    layers: tuple[LayerParts, ...]
    final_norm: NormReaders   # readers: the output embedding
    head: str
    hidden: int
    head_dim: int


def _fail(model: nn.Module, module: str, why: str) -> QuantizationError:
    return QuantizationError(f"rotation cannot be fused into {type(model).__name__}: {module} {why}")


def _weight2d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return w is not None and w.dim() == 2


def _norm_like(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return len(m._modules) == 0 and w is not None and w.dim() == 1


def _layer_parts(model: nn.Module, name: str, layer: nn.Module, maps, hidden: int) -> LayerParts:
    def full(rel: str) -> str:
        return f"{name}.{rel}"

    def has(rel: str) -> bool:
        try:
            layer.get_submodule(rel)
            return True
        except AttributeError:
            return False

    norms, writers, seen = [], [], set()
    for m in expand_for_layer(maps, layer):
        if not all(has(t) for t in m.targets):
            continue  # an alternative mapping of the family (e.g. with and without q_lora_rank)
        if m.kind is SourceKind.LINEAR:
            writers += [full(t) for t in m.targets]
            continue
        if "." in m.source:
            raise _fail(model, full(m.source), "is a norm inside a sub-block (not on the residual stream)")
        if m.kind not in FOLDABLE:
            raise _fail(model, full(m.source), f"is a {m.kind.value} norm, which does not commute with a rotation")
        src = layer.get_submodule(m.source)
        if getattr(src, "bias", None) is not None or src.weight.shape != (hidden,):
            raise _fail(model, full(m.source), f"is not an RMS norm over the {hidden} residual channels")
        norms.append(NormReaders(full(m.source), m.kind, tuple(full(t) for t in m.targets + m.float_targets)))
        seen.add(m.source)
    if not has(ATTN_O) or not has(ATTN_V):
        raise _fail(model, full(ATTN_O if not has(ATTN_O) else ATTN_V), "does not exist (no per-head v/o to rotate)")
    writers.insert(0, full(ATTN_O))
    for child, mod in layer.named_children():
        if child not in seen and _norm_like(mod):
            raise _fail(model, full(child), "is a norm that feeds no linear (e.g. after o_proj/down_proj, before the "
                                            "residual add): the residual stream cannot be rotated by fusion")
    known = {r for n in norms for r in n.readers} | set(writers)
    for rel, mod in layer.named_modules():
        if rel and _weight2d(mod) and full(rel) not in known:
            raise _fail(model, full(rel), "neither reads nor writes the residual stream by lowbit's mapping table")
    return LayerParts(name, tuple(norms), tuple(writers), full(ATTN_V), full(ATTN_O))


def residual_layout(model: nn.Module) -> ResidualLayout:
    """The layout of ``model`` (module docstring), or a QuantizationError naming what stops a fused
    rotation."""
    maps = mappings_for(model, include_mlp_inner=True)
    if maps is None:
        raise _fail(model, f"model_type {model_type(model)!r}", "has no norm -> linear mapping in lowbit")
    bad = [m for m in maps if m.kind is not SourceKind.LINEAR and m.kind not in FOLDABLE]
    if bad:
        raise _fail(model, bad[0].source, f"is a {bad[0].kind.value} norm, which does not commute with a rotation")
    names = {m: n for n, m in model.named_modules()}
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if base is None or base is model or not isinstance(layers, nn.ModuleList) or not isinstance(norm, nn.Module):
        raise _fail(model, "the base model", "has no decoder `layers` and final `norm`")
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or not _weight2d(head if head is not None else nn.Module()):
        raise _fail(model, "the input/output embedding", "is not an nn.Embedding / a module with a 2-D weight")
    hidden = emb.weight.shape[1]
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    parts = tuple(_layer_parts(model, names[layer], layer, maps, hidden) for layer in layers)
    kinds = {n.kind for p in parts for n in p.norms}
    if len(kinds) != 1:
        raise _fail(model, names[layers], f"mixes norm kinds {sorted(k.value for k in kinds)}")
    if getattr(norm, "bias", None) is not None or not _norm_like(norm) or norm.weight.shape != (hidden,):
        raise _fail(model, names[norm], f"is not an RMS norm over the {hidden} residual channels")
    final = NormReaders(names[norm], kinds.pop(), (names[head],))
    return ResidualLayout(names[emb], parts, final, names[head], hidden, head_dim)
