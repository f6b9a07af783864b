"""The data of a model-free plan (``lowbit.modelfree.plan``): what each tensor becomes (``Kind``,
``Item``), where its values come from (``Source``, ``ExpertPart``), the whole run's ``Plan``, and
the scheme-free ``Survey`` a plan is made from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Iterable

import torch

from lowbit.files.folder import DTYPES
from lowbit.files.tensors import TensorInfo
from lowbit.modelfree.mxfp4_source import dequantized_shape
from lowbit.modelfree.source import Checkpoint
from lowbit.moe import FusedLayout, Proj, part_shape
from lowbit.schemes import Scheme


class Kind(str, Enum):
    QUANTIZE = "quantize"  # a linear weight, written as the layout's tensors
    COPY = "copy"          # written unchanged (dequantized to the model dtype if FP8)
    DROP = "drop"          # not written (tied duplicate, consumed source scale)


@dataclass(frozen=True)
class ExpertPart:
    """One expert's projection (or its bias) inside a fused experts tensor (``lowbit.moe.slices``)."""

    expert: int
    proj: Proj
    layout: FusedLayout
    num_experts: int


@dataclass(frozen=True)
class Source:
    """A float tensor as stored: plain, or FP8 with its block scale (anywhere in the checkpoint),
    or one expert's part of a fused experts tensor (``part``)."""

    info: TensorInfo
    scale_inv: TensorInfo | None = None
    part: ExpertPart | None = None
    mx_scales: TensorInfo | None = None  # info is gpt-oss MXFP4 blocks, dequantized with these scales

    @property
    def shape(self) -> tuple[int, ...]:
        """The tensor's shape as quantized or written (an expert part's own shape)."""
        full = self.info.shape if self.mx_scales is None else dequantized_shape(self.info.shape)
        if self.part is None:
            return full
        return part_shape(full, self.part.proj, self.part.layout)

    @property
    def nbytes(self) -> int:
        """Source bytes this tensor stands for (an expert part: its share of the fused tensor)."""
        if self.part is None:
            return self.info.nbytes
        full = self.info.shape if self.mx_scales is None else dequantized_shape(self.info.shape)
        return self.info.nbytes * math.prod(self.shape) // math.prod(full)

    @property
    def key(self) -> str:
        """A name that tells parts of one fused tensor apart."""
        p = self.part
        return self.info.name if p is None else f"{self.info.name}[{p.expert}].{p.proj.value}"


@dataclass(frozen=True)
class Item:
    kind: Kind
    name: str                      # output tensor name (COPY) or the linear's module (QUANTIZE)
    src: Source
    group: tuple[Source, ...] = ()  # QUANTIZE: weights sharing the NVFP4 global scale (self included)
    scheme: Scheme | None = None   # QUANTIZE: its scheme (make_plan sets it; None: the run's one scheme)


@dataclass
class Plan:
    scheme: Scheme | None                   # the one scheme (None: a scheme per linear, ``schemes``)
    dtype: torch.dtype                      # the model's float dtype (FP8 sources dequantize to it)
    fp8_block: tuple[int, int] | None       # the FP8 source's weight_block_size
    shards: dict[str, list[Item]]           # source shard -> items in the shard's data order
    quantized: list[str] = field(default_factory=list)  # linear modules quantized
    ignored: list[str] = field(default_factory=list)    # linear-like modules kept in float
    config_updates: dict[str, Any] = field(default_factory=dict)
    schemes: dict[str, Scheme] = field(default_factory=dict)  # quantized module -> its scheme


@dataclass
class Survey:
    """What a checkpoint holds, decided without a scheme (``survey``): the kind of every tensor, the
    modules quantized and kept in float, fused experts' parts, the tied head. ``plan_of`` turns it
    into a ``Plan`` under an ``Assignment``; ``keep_float`` first moves modules a recipe leaves in
    float (lowbit.modelfree.mixed) as ``ignore`` would have, so the checkpoint is surveyed once."""

    ckpt: Checkpoint
    is_fp8: bool
    block: tuple[int, int] | None
    kinds: dict[str, Kind]
    module_of: dict[str, str]                              # linear weight tensor -> its module
    scale_of: dict[str, TensorInfo]                        # FP8 weight -> its block scale
    mx_of: dict[str, TensorInfo]                           # MXFP4 blocks -> their scales
    expanded: dict[str, list[tuple[Kind, str, ExpertPart]]]  # fused tensor -> its experts' parts
    parts_of: dict[str, tuple[TensorInfo, ExpertPart]]     # expert linear -> its fused source
    extra: list[tuple[str, TensorInfo]]                    # (head module, embedding) quantized from the embedding
    heads: list[str]
    quantized: list[str]
    ignored: list[str]
    untie: bool                                            # tied config, head included: untied if one is quantized

    def keep_float(self, modules: Iterable[str]) -> "Survey":
        """This survey with ``modules`` (names of ``quantized``) kept in float, as if ``ignore`` had
        named them: their weights copied, listed in ``ignored`` (a tied head quantized from the
        embedding is simply not made)."""
        k = set(modules)
        if not k:
            return self
        kinds, ignored = dict(self.kinds), list(self.ignored)
        for name, m in self.module_of.items():
            if m in k:
                kinds[name] = Kind.COPY
                ignored.append(m)
        expanded = {n: [(Kind.COPY, f"{o}.weight", p) if kind is Kind.QUANTIZE and o in k else (kind, o, p)
                        for kind, o, p in parts] for n, parts in self.expanded.items()}
        ignored += [m for m in self.parts_of if m in k]
        return replace(self, kinds=kinds, expanded=expanded, ignored=ignored,
                       module_of={n: m for n, m in self.module_of.items() if m not in k},
                       parts_of={m: v for m, v in self.parts_of.items() if m not in k},
                       extra=[(m, e) for m, e in self.extra if m not in k],
                       quantized=[m for m in self.quantized if m not in k])


def source_dtype(src: Source, model_dtype: torch.dtype) -> torch.dtype:
    """The float dtype a source tensor is read as (FP8 and MXFP4 dequantize to the model's dtype)."""
    return model_dtype if src.scale_inv is not None or src.mx_scales is not None else DTYPES[src.info.dtype]
