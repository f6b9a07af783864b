"""A model built without its weights, filled from its checkpoint one module at a time.

    skel = Skeleton.open(folder)        # checks the folder (models.float_check), builds the model
                                        # class from config.json with every parameter on the meta
                                        # device (buffers computed on the CPU, as from_pretrained
                                        # computes them), splits MoE experts (moe.split_experts) and
                                        # makes Conv1D projections linears (linearize)
    skel.materialize(module, prefix)    # reads the module's parameters and persistent buffers
                                        # from the shards (memory-mapped, lowbit.files.tensors),
                                        # in float32 as lowbit.load_model loads them
    skel.release(module)                # back to the meta device: its memory is freed

The values equal what ``lowbit.load_model`` (``from_pretrained(dtype=float32)`` and
``split_experts``) holds, tensor for tensor: every checkpoint tensor is converted with ``.to``
exactly as transformers converts it, and MoE experts are read by the rules lowbit writes them
with: per-expert names (most families; Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2`` through
``moe.naming``) or the experts fused on disk (gpt-oss, GraniteMoE: sliced by ``moe.slices``; Inkling's weighted
shared experts, one fused tensor per projection, ``moe.weighted_shared``); a
linear applied per input group (DeepSeek-V4's ``o_a_proj``, ``moe.row_groups``) from row blocks
of its one stored weight. Keys
transformers renames when it loads the folder (Nemotron-H's ``backbone.``) are found by its own
conversion mapping (``lowbit.renames``). A parameter that the checkpoint does not hold is a
FormatError naming it, except a tied output embedding.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
import torch.nn as nn

from lowbit.errors import FormatError
from lowbit.files.tensors import TensorReader
from lowbit.modelfree.source import Checkpoint
from lowbit.linearize import conv1d_as_linears
from lowbit.renames import checkpoint_renames
from lowbit.moe import split_experts
from lowbit.moe.naming import checkpoint_names, stored_key
from lowbit.moe.fused_source import FusedSource, fused_source
from lowbit.moe.slices import expert_part

DTYPE = torch.float32  # what lowbit.load_model loads (and calibrates) in


class Skeleton:
    def __init__(self, folder: Path, model: nn.Module, ckpt: Checkpoint, transposed: frozenset[str] = frozenset(),
                 renames: dict[str, str] | None = None) -> None:
        self.folder = folder
        self.model = model
        self.ckpt = ckpt
        self.transposed = transposed  # keys of Conv1D weights made linears: stored [in, out] on disk
        self.renames = renames or {}  # model key -> checkpoint key transformers renames (lowbit.renames)
        self._reader = TensorReader(folder)
        self._lock = threading.Lock()  # the reader's maps are shared by the prefetch thread
        self.model_type = getattr(model.config, "model_type", None)

    @classmethod
    def open(cls, folder: str | Path) -> "Skeleton":
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        from lowbit.models.float_check import check_float_folder

        folder = Path(folder)
        check_float_folder(folder)
        ckpt = Checkpoint(folder)
        config = AutoConfig.from_pretrained(folder)
        with init_empty_weights(include_buffers=False):  # parameters on meta, buffers computed
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPE)
        model.config.name_or_path = str(folder)
        if (folder / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(folder)
        model.eval()
        renames = checkpoint_renames(model, ckpt.tensors)  # before the split: transformers' own model
        split_experts(model)
        conv = conv1d_as_linears(model)  # read transposed (lowbit.linearize)
        return cls(folder, model, ckpt, frozenset(f"{n}.weight" for n in conv), renames)

    # ------------------------------------------------------------------ names
    def _stored(self, key: str) -> str | None:
        """The checkpoint key of the model tensor ``key`` stored whole, or None."""
        return stored_key(self.model_type, key, self.ckpt.tensors, self.renames)

    def _disk_name(self, key: str) -> str | FusedSource:
        """Where the checkpoint keeps the model tensor ``key``."""
        disk = self._stored(key)
        if disk is not None:
            return disk
        fused = fused_source(self.model, key, self._stored)
        if fused is not None:
            return fused
        disk = checkpoint_names(self.model_type, [key])[key]
        raise FormatError(f"{self.folder}: the checkpoint holds no tensor {disk!r} (the model's {key!r})")

    def _read(self, key: str) -> torch.Tensor:
        where = self._disk_name(key)
        with self._lock:
            if isinstance(where, FusedSource):
                t = self._reader.get(self.ckpt.tensors[where.disk])
                return expert_part(t.to(DTYPE), where.expert, where.proj, where.layout)
            t = self._reader.get(self.ckpt.tensors[where])
            if key in self.transposed:
                return t.to(DTYPE).t().contiguous()
            return t.to(DTYPE) if t.dtype.is_floating_point else t.clone()

    # ------------------------------------------------------------------ loading
    def read_module(self, module: nn.Module, prefix: str, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """The state of ``module`` (named ``prefix``, "" for the model) read from the checkpoint:
        relative key -> tensor, leaving out the relative keys in ``skip``. A tied output embedding
        absent from the checkpoint is left out (``tie`` restores it)."""
        head = self._tied_head_key()
        out = {}
        for rel in module.state_dict(keep_vars=True):
            if rel in skip:
                continue
            key = f"{prefix}.{rel}" if prefix else rel
            if key == head and self._stored(key) is None:
                continue
            out[rel] = self._read(key)
        return out

    def assign(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Put ``state`` (from ``read_module``) into ``module`` in place of its meta tensors."""
        missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
        if unexpected:  # pragma: no cover - read_module reads the module's own keys
            raise FormatError(f"unexpected tensors {unexpected[:3]}")
        for p in module.parameters():
            p.requires_grad_(False)

    def materialize(self, module: nn.Module, prefix: str) -> None:
        self.assign(module, self.read_module(module, prefix))

    def _tied_head_key(self) -> str | None:
        if not getattr(self.model.config, "tie_word_embeddings", False):
            return None
        head = self.model.get_output_embeddings()
        for n, m in self.model.named_modules():
            if m is head:
                return f"{n}.weight"
        return None

    def _kept(self, layers_path: str) -> list[str]:
        """The modules outside the decoder layers that are not read from the checkpoint: the decoder
        layers, and the linears outside them already quantized (``calibration.outside``)."""
        from lowbit.checkpoint.save import quantized_modules

        return [layers_path] + [n for n in quantized_modules(self.model) if not n.startswith(layers_path + ".")]

    def materialize_outside(self, layers_path: str) -> None:
        """Every tensor outside the decoder layers (embeddings, final norm, output head) but the
        quantized linears, then the tied output embedding."""
        kept = self._kept(layers_path)
        skip = {k for k in self.model.state_dict(keep_vars=True) if any(k.startswith(p + ".") for p in kept)}
        self.assign(self.model, self.read_module(self.model, "", skip))
        if self._tied_head_key() is not None:
            head, emb = self.model.get_output_embeddings(), self.model.get_input_embeddings()
            head.weight = emb.weight

    def release_outside(self, layers_path: str) -> None:
        """Every parameter outside the decoder layers back to the meta device (after the first
        layer's inputs are captured nothing runs them until the end, when ``materialize_outside``
        reads them again for the output), but the quantized linears (they are written at the end)."""
        kept = self._kept(layers_path)
        for name, m in self.model.named_modules():
            if any(name == p or name.startswith(p + ".") for p in kept):
                continue
            for k, p in list(m.named_parameters(recurse=False)):
                setattr(m, k, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))

    @staticmethod
    def release(module: nn.Module) -> None:
        module.to("meta")

    def close(self) -> None:
        with self._lock:
            self._reader.close()
