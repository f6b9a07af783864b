"""GGUF as a registered checkpoint format (``Format.GGUF``, ``lowbit.formats.FORMATS``): one file
for llama.cpp, written whole. The format owns its rules:

- what it holds (``check_scheme`` / ``target``): llama.cpp's GGML types, one for every tensor
  llama-quantize quantizes (``q4_k``: ``--pure``), or one of llama-quantize's mixes (``Q4_K_M``);
  never a lowbit ``Scheme``;
- the type of every tensor (``tensor_types``): the mix's rules or the one type, llama-quantize's
  ``--tensor-type`` overrides, and its fallback when a block does not divide a row (Q4_K -> Q5_0
  ..., then F16: ``lowbit.formats.gguf.mixes``);
- what it writes, declared (``tensor_specs``: GGUF name -> shape and type, in the file's order)
  from llama.cpp's converter's plan (``lowbit.formats.gguf.convert``: metadata, names, rows);
- the output (``check_output``: one file, not a folder, never inside the source) and the writing
  (``write``: ``lowbit.formats.gguf.writer``, under a temporary name renamed when complete).

``lowbit.quantize_gguf`` (the float folder, with importance and GPTQ) and ``lowbit.save(model,
"x.gguf", format="gguf")`` (a model quantized in memory to a GGML type, ``lowbit.gguf_memory``)
both write through it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from lowbit.errors import FormatError, OptionRef
from lowbit.formats.base import Format
from lowbit.formats.checkpoint_format import CheckpointFormat, Container
from lowbit.formats.gguf.mixes import F16, Mix, choose_types, fallback, quantizable
from lowbit.numerics.ggml import GgmlType, ImportanceSearch

#: what a GGUF file is quantized to: a llama-quantize mix, or one GGML type for every tensor
GgufTarget = Mix | GgmlType


@dataclass(frozen=True)
class GgufTensorSpec:
    """One tensor the file holds: its shape in numpy order (the last axis is the input dimension,
    GGUF's ne0) and its type as gguf-py names it (``Q4_K``, ``F16``, ``F32``)."""

    shape: tuple[int, ...]
    type: str


class GgufFormat(CheckpointFormat):
    """llama.cpp's GGUF file (module docstring)."""

    format = Format.GGUF
    container = Container.FILE

    def target(self, scheme: Any) -> GgufTarget:
        """A mix name (``Q4_K_M``) or one GGML type for every tensor (``q4_k``: llama-quantize
        ``--pure``), as given or by name (a mix first: ``q8_0`` is the mix Q8_0); FormatError naming
        both lists otherwise, and for a lowbit ``Scheme``."""
        from lowbit.schemes import Scheme

        if isinstance(scheme, (Mix, GgmlType)):
            return scheme
        if isinstance(scheme, Scheme) or not isinstance(scheme, str):
            what = scheme.name if isinstance(scheme, Scheme) else type(scheme).__name__
            raise FormatError(f"format 'gguf' holds llama.cpp's GGML types (q8_0 ... nvfp4) and mixes (Q4_K_M ...), "
                              f"not lowbit's scheme {what!r}: quantize with one of them (e.g. scheme='q4_k')")
        v = scheme.strip()
        try:
            return Mix(v.upper())
        except ValueError:
            pass
        try:
            return GgmlType(v.lower())
        except ValueError:
            raise FormatError(f"unknown GGUF scheme {scheme!r}: a llama.cpp mix ({', '.join(m.value for m in Mix)}) or "
                              f"one GGML type ({', '.join(t.value for t in GgmlType)})") from None

    def check_scheme(self, scheme: Any) -> None:
        self.target(scheme)

    @staticmethod
    def file_type(target: GgufTarget) -> Mix | None:
        """``general.file_type``: the mix's, none for one GGML type (llama-quantize ``--pure``
        writes the type's own; lowbit leaves the key to the reader, as it always has)."""
        return target if isinstance(target, Mix) else None

    @staticmethod
    def overrides(overrides: Mapping[str, str] | None) -> list[tuple[re.Pattern, GgmlType]]:
        """llama-quantize's ``--tensor-type PATTERN=TYPE``: (regex searched in the GGUF name, type)."""
        out = []
        for pattern, kind in (overrides or {}).items():
            try:
                out.append((re.compile(pattern), GgmlType(str(kind).lower())))
            except re.error as e:
                raise FormatError(f"GGUF tensor-type override {pattern!r}: not a regular expression ({e})") from None
            except ValueError:
                raise FormatError(f"GGUF tensor-type override {pattern!r}: unknown GGML type {kind!r}") from None
        return out

    @staticmethod
    def check_output(src: str | os.PathLike | None, out: str | os.PathLike, overwrite: bool) -> None:
        """Before any work: FormatError when ``out`` is a folder, exists (without ``overwrite``), or
        lies inside the source folder ``src`` (None: no source folder to protect)."""
        out = Path(out)
        if out.is_dir():
            raise FormatError(f"GGUF output {str(out)!r} is a folder: a GGUF output is one file (e.g. "
                              f"model-Q4_K_M.gguf)")
        if out.exists() and not overwrite:
            raise FormatError(f"GGUF output {str(out)!r} exists (pass {{overwrite}} to replace it)",
                              overwrite=OptionRef("overwrite"))
        if src is not None:
            src = Path(src).resolve()
            if out.resolve() == src or src in out.resolve().parents:
                raise FormatError(f"GGUF output {str(out)!r} lies inside the source folder {str(src)!r}")

    def tensor_types(self, plan, target: GgufTarget, has_importance: bool = False,
                     overrides: Mapping[str, str] | None = None) -> dict[str, GgmlType | str | None]:
        """Every tensor's type for ``target`` (a mix, or one type for all: ``--pure``), overrides
        first (the first matching pattern wins, as in llama-quantize), then the shape fallbacks:
        a GgmlType, ``F16``, or None (kept as the converter wrote it)."""
        from lowbit.formats.gguf.writer import facts_of, plan_shapes

        shapes = plan_shapes(plan)
        rules = self.overrides(overrides)
        if isinstance(target, Mix):
            types = choose_types(target, shapes, facts_of(plan, has_importance))
        else:
            types = {n: (fallback(target, s[-1]) if quantizable(n, s) else None) for n, s in shapes}
        for name, shape in shapes:
            if types.get(name) is None:
                continue
            for pattern, kind in rules:
                if pattern.search(name):
                    types[name] = fallback(kind, shape[-1])
                    break
        return types

    @staticmethod
    def tensor_specs(plan, types: Mapping[str, GgmlType | str | None]) -> dict[str, GgufTensorSpec]:
        """What ``write`` writes for ``plan`` under ``types``, without any data: GGUF name ->
        GgufTensorSpec, in the file's order (tests/formats/gguf/test_gguf_format.py holds the
        written file to it)."""
        from lowbit.formats.gguf.rowmap import RowMap
        from lowbit.formats.gguf.writer import plan_shapes

        out = {}
        for t, (name, shape) in zip(plan.tensors, plan_shapes(plan)):
            kind = types.get(name)
            if isinstance(kind, GgmlType):
                out[name] = GgufTensorSpec(shape, kind.name)
            elif kind == F16:
                out[name] = GgufTensorSpec(shape, "F16")
            elif isinstance(t, RowMap):
                out[name] = GgufTensorSpec(shape, "F32")
            else:
                import gguf

                out[name] = GgufTensorSpec(shape, gguf.GGMLQuantizationType(t.type).name)
        return out

    def write(self, plan, out: str | os.PathLike, weights: Mapping[str, Any] | Callable[[str], Any], target: GgufTarget,
              types: Mapping[str, GgmlType | str | None], *, importance: Mapping[str, Any] | None = None,
              encoded: Mapping[str, tuple[GgmlType, Any]] | None = None,
              progress: Callable[[str], None] | None = None, search=None):
        """Write the file (``lowbit.formats.gguf.writer.write_gguf``: ``weights`` HF name -> float
        tensor, ``encoded`` HF name -> (type, rows already encoded); ``search``: how ``importance``
        chooses the scales, ``ImportanceSearch``, required with it); its ``WriteReport``."""
        from lowbit.formats.gguf.writer import write_gguf

        if importance and search is None:
            raise ValueError("an importance matrix needs its search (lowbit.numerics.ggml.ImportanceSearch)")
        return write_gguf(plan, out, weights, types, file_type=self.file_type(target), importance=importance,
                          encoded=encoded, progress=progress, search=search or ImportanceSearch.LLAMA_CPP)
