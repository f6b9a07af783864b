"""Everything in a GGUF file but the quantized weights, from llama.cpp's own converter.

``plan_gguf(folder)`` runs the converter's model class for the folder's architecture (the class
``convert_hf_to_gguf.py`` would pick) through its own steps, ``prepare_tensors`` then
``prepare_metadata``, and keeps what it would write instead of writing it:

- every metadata key/value (``general.*``, the architecture's hyperparameters, the tokenizer, the
  chat template), except ``general.file_type``, which depends on the types chosen later;
- for every tensor it writes, in its order: a ``RowMap`` (which rows of which HF tensors, values
  unchanged) for the weights lowbit quantizes, or a ``FloatTensor`` (the array it produced, e.g.
  Gemma's norms with 1 added) for the others.

How: a subclass of the converter's class (made per call, nothing of the converter is replaced)
serves the HF tensors from ``tensors`` (the folder's safetensors by default), an index pattern
(``rowmap.pattern``) in place of each quantized weight, and collects the tensors with a
``GGUFWriter`` subclass that keeps a row map per pattern tensor instead of its data. A second
``prepare_tensors`` run with other values in the patterns finds the float tensors made from a
quantized weight: such a weight (its values or input dimension changed by the converter) cannot
carry lowbit's codes, and a FormatError names it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from lowbit.errors import FormatError, LowbitError
from lowbit.formats.gguf.deps import converter, model_class
from lowbit.formats.gguf.rowmap import RowMap, decode, pattern

# written by the GGUF writer from the types it chooses, not taken from the converter's F32 run
LEFT_TO_WRITER = ("general.file_type",)


@dataclass(frozen=True)
class FloatTensor:
    """A GGUF tensor kept as the converter produced it (float32, or the type it forced)."""

    name: str
    array: np.ndarray
    type: Any  # gguf.GGMLQuantizationType


@dataclass
class GGUFPlan:
    """What llama.cpp's converter writes for a folder, tensor data left out.

    ``metadata``: key -> ``gguf.GGUFValue`` in the converter's order (``general.architecture``
    included, ``general.file_type`` left to the writer). ``tensors``: ``RowMap`` or
    ``FloatTensor`` per GGUF tensor, in the converter's order. ``dropped``: HF tensors the
    converter writes nowhere (vision towers, rotary tables, ...)."""

    hf_arch: str
    arch: str
    metadata: dict[str, Any]
    tensors: list[RowMap | FloatTensor]
    dropped: tuple[str, ...] = ()

    def rowmaps(self) -> dict[str, RowMap]:
        return {t.name: t for t in self.tensors if isinstance(t, RowMap)}

    def floats(self) -> dict[str, FloatTensor]:
        return {t.name: t for t in self.tensors if isinstance(t, FloatTensor)}

    def add_metadata(self, writer) -> None:
        """Add every key/value to a ``gguf.GGUFWriter`` (made with ``arch=plan.arch``, which
        already holds ``general.architecture``)."""
        for key, v in self.metadata.items():
            if key != "general.architecture":
                writer.add_key_value(key, v.value, v.type, v.sub_type)


def quantized_default(name: str, shape: tuple[int, ...]) -> bool:
    """The weights that carry lowbit's codes unless told otherwise: every tensor of 2 or more axes."""
    return len(shape) >= 2


def gguf_keys(path: str | Path, prefix: str = "") -> dict[str, Any]:
    """The key/values of a GGUF file whose name starts with ``prefix``, as ``gguf.GGUFValue``
    (read from the header, ``lowbit.formats.gguf.keys``; gguf-py's reader where that one does not
    read the file)."""
    import gguf

    from lowbit.formats.gguf.keys import Unsupported, read_keys

    try:
        try:
            kv = read_keys(path)
        except Unsupported:
            reader = gguf.GGUFReader(path)
            kv = {k: (f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
                  for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except (OSError, ValueError) as e:
        raise FormatError(f"GGUF: cannot read {str(path)!r}: {e}") from None
    return {k: gguf.GGUFValue(value=v, type=gguf.GGUFValueType(t), sub_type=None if s is None else gguf.GGUFValueType(s))
            for k, (v, t, s) in kv.items() if k.startswith(prefix)}


def _swapped(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if len(shape) >= 2 else shape


def _shape(tensors: Mapping[str, Any], name: str) -> tuple[int, ...]:
    from lowbit.files.folder import SafetensorsFolder

    if isinstance(tensors, SafetensorsFolder):  # from the header, nothing read
        return tuple(tensors.info(name)[1])
    return tuple(tensors[name].shape)


@dataclass
class _Capture:
    """The state of one run: the HF tensors served, the pattern ids, what was written."""

    folder: Path
    tensors: Mapping[str, Any]
    quantized: list[str]
    shapes: list[tuple[int, ...]]
    sid: dict[str, int] = field(default_factory=dict)
    last: str | None = None  # the HF tensor the converter read last
    written: list[RowMap | FloatTensor] = field(default_factory=list)
    used: set[int] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    from_folder: bool = True  # the tensors are the folder's own: the converter must index the same names
    expect: dict[str, np.ndarray] | None = None  # the check run: the float tensors of the plan run
    seen: list[tuple[str, str | None, bool]] = field(default_factory=list)  # check run: (name, last, same)
    to_checkpoint: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None
    transposed: frozenset[str] = frozenset()  # served as the transpose of a pattern: rows are columns
    own_vocab: bool = True  # False: the tokenizer keys come from another GGUF (the converter's step is not run)

    def __post_init__(self) -> None:
        self.sid = {n: i for i, n in enumerate(self.quantized)}
        # the shapes the patterns are laid in (a transposed source's last two axes swapped)
        self.laid = [_swapped(s) if n in self.transposed else s for n, s in zip(self.quantized, self.shapes)]

    def load(self, name: str) -> torch.Tensor:
        """HF tensor ``name`` as the converter gets it: a quantized one's index pattern deferred
        (the converter's lazy tensors: made when what it goes into is written, so a layer's
        stacked experts exist as patterns one projection at a time), another tensor as it is."""
        from lowbit.formats.gguf.deps import converter

        lazy = converter().LazyTorchTensor
        if name in self.sid:
            shape = self.shapes[self.sid[name]]  # the HF shape: a transposed pattern is laid swapped, served back
            return lazy(meta=torch.empty(shape, dtype=torch.float32, device="meta"), args=(),
                        func=functools.partial(self._pattern, name))
        self.last = name
        t = self.tensors[name]
        return lazy.from_eager(t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(np.asarray(t)))

    def _pattern(self, name: str) -> torch.Tensor:
        self.last = name
        i = self.sid[name]
        p = pattern(i, self.laid[i], name)
        if name in self.transposed:
            p = np.ascontiguousarray(np.swapaxes(p, -1, -2))
        return torch.from_numpy(p if self.expect is None else -p - 1)  # the check run: other values

    def _given(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.last = name
        return t.detach()

    def served(self) -> dict[str, Callable[[], torch.Tensor]]:
        """Checkpoint name -> loader: lowbit's tensors, or what ``to_checkpoint`` makes of all of
        them at once (patterns included, so row maps reach back through it)."""
        if self.to_checkpoint is None:
            return {n: functools.partial(self.load, n) for n in self.tensors}
        whole = self.to_checkpoint({n: self.load(n) for n in self.tensors})
        return {n: functools.partial(self._given, n, t) for n, t in whole.items()}

    def index(self, model, found: Mapping[str, Any]) -> dict[str, Callable[[], torch.Tensor]]:
        ours: dict[str, Callable[[], torch.Tensor]] = {}
        for name, load in self.served().items():
            item = model.filter_tensors((name, load))
            if item is None:
                self.skipped.append(name)
                continue
            key, gen = item
            ours[key] = gen
        if self.from_folder and found and set(found) != set(ours):
            odd = sorted(set(found) ^ set(ours))[0]
            raise FormatError(f"GGUF: llama.cpp's converter reads tensor {odd!r} of {str(self.folder)!r} under a name "
                              f"lowbit does not serve (it renames tensors while indexing them)")
        return ours

    def add(self, name: str, array: Any, raw_dtype: Any) -> None:
        import gguf

        arr = np.asarray(gguf.LazyNumpyTensor.to_eager(array))  # the converter's lazy tensor, made here
        if self.expect is not None:
            ref = self.expect.get(name)
            self.seen.append((name, self.last, ref is None or np.array_equal(arr, ref)))
            return
        floaty = raw_dtype in (None, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        found = decode(arr, self.laid) if floaty else None
        if found is None:
            self.written.append(FloatTensor(name=name, array=arr, type=raw_dtype or gguf.GGMLQuantizationType.F32))
            return
        sid, row = found
        used = np.unique(sid)
        self.used.update(int(s) for s in used)
        names = tuple(self.quantized[s] for s in used)
        flags = tuple(n in self.transposed for n in names)
        self.written.append(RowMap(name=name, shape=tuple(arr.shape), sources=names,
                                   source_shapes=tuple(self.laid[s] for s in used),
                                   source=np.searchsorted(used, sid).astype(np.int32), row=row,
                                   transposed=flags if any(flags) else ()))

    def changed(self, plan: list[RowMap | FloatTensor]) -> list[tuple[str, str | None]]:
        """After the check run: (GGUF name, the HF tensor the converter read last) of every float
        tensor of the plan that changed with the quantized weights' values (the converter made it
        from one of them); FormatError when the tensor list itself changed."""
        if [n for n, _, _ in self.seen] != [t.name for t in plan]:
            raise FormatError(f"GGUF: llama.cpp's converter writes other tensors for {str(self.folder)!r} when the "
                              f"weights' values change, so lowbit cannot map their rows")
        return [(name, last) for name, last, same in self.seen if not same]

    def refusal(self, name: str, last: str | None) -> FormatError:
        src = repr(last) if last in self.sid else "a quantized tensor"
        return FormatError(f"GGUF: llama.cpp's converter changes the values or the input dimension of tensor "
                           f"{src} (written as {name!r}), so it cannot carry lowbit's codes; leave it unquantized")


def _writer_class():
    import gguf

    class CaptureWriter(gguf.GGUFWriter):
        """A GGUFWriter that hands each tensor to the capture instead of keeping its data."""

        def __init__(self, arch: str, capture: _Capture) -> None:
            super().__init__(path=None, arch=arch)
            self._capture = capture

        def add_tensor(self, name, tensor, raw_shape=None, raw_dtype=None, tensor_endianess=None):
            shape = raw_shape if raw_shape is not None else tensor.shape
            self.add_tensor_info(name, shape, tensor.dtype, tensor.nbytes, raw_dtype=raw_dtype)
            self._capture.add(name, tensor, raw_dtype)

    return CaptureWriter


def _capturing(base: type) -> type:
    """A subclass of the converter's model class that serves lowbit's tensors and captures."""
    writer_cls = _writer_class()

    def __init__(self, *args, capture: _Capture, **kwargs):
        self._lowbit_capture = capture
        base.__init__(self, *args, **kwargs)
        own = self.gguf_writer
        self.gguf_writer = writer_cls(own.arch, capture)
        self.gguf_writer.kv_data, self.gguf_writer.tensors = own.kv_data, own.tensors

    def index_tensors(self, remote_hf_model_id=None):
        found = base.index_tensors(self, remote_hf_model_id)
        return self._lowbit_capture.index(self, found)

    def set_vocab(self):  # the converter's tokenizer step, unless the keys come from another file
        if self._lowbit_capture.own_vocab:
            base.set_vocab(self)

    return type("Lowbit" + base.__name__, (base,), {"model_arch": base.model_arch, "__init__": __init__,
                                                      "index_tensors": index_tensors, "set_vocab": set_vocab,
                                                      "__module__": __name__})


def _where(e: BaseException) -> str:
    """'in <function>' of the innermost frame of the converter's own code in ``e``'s traceback."""
    tb, name = e.__traceback__, "?"
    while tb is not None:
        if "/conversion/" in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    return f"in {name}"


def _run(cls: type, capture: _Capture, hf_arch: str, metadata: bool):
    """The converter's own steps on lowbit's tensors; its errors as one FormatError line."""
    import gguf

    folder = capture.folder
    try:
        with torch.inference_mode():
            model = _capturing(cls)(folder, gguf.LlamaFileType.ALL_F32, folder / "lowbit-plan.gguf",
                                    eager=False, capture=capture)
            model.prepare_tensors()
            if metadata:
                model.prepare_metadata(vocab_only=False)  # general.*, hyperparameters, then the tokenizer
    except LowbitError:
        raise
    except Exception as e:  # the converter's own refusals: one line naming the folder and where
        raise FormatError(f"GGUF: llama.cpp's converter failed on {str(folder)!r} ({hf_arch}) {_where(e)}: "
                          f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}") from e
    return model


def _planned(cls, folder: Path, source, qnames: list[str], shapes: list, hf_arch: str, metadata: bool,
             from_folder: bool, to_checkpoint, chosen: bool, own_vocab: bool = True):
    """(the converter's model, the plan run's capture): the converter run on the patterns, then
    again with other values in them (a float tensor made from a quantized one changes: refused,
    naming it). Before refusing, at most two more tries: the quantized tensors no row map used
    are served transposed (the converter writes their columns as rows: experts stored [E, in,
    out], gpt-oss's and Llama 4's; GPT-2's Conv1D [in, out]); and, when the caller did not choose the
    quantized tensors (``chosen`` False: the default of every tensor of 2 or more axes), one the
    converter changes and writes under a name llama-quantize never quantizes (not ``*.weight``:
    gpt-oss's de-interleaved expert biases) is served as itself, float as the converter writes it."""
    transposed: frozenset[str] = frozenset()
    tries = 0  # the runs after the first: at most two (each refusal names a tensor)
    while True:
        capture = _Capture(folder=folder, tensors=source, quantized=qnames, shapes=shapes, from_folder=from_folder,
                           to_checkpoint=to_checkpoint, transposed=transposed, own_vocab=own_vocab)
        model = _run(cls, capture, hf_arch, metadata=metadata)
        floats = {t.name: t.array for t in capture.written if isinstance(t, FloatTensor)}
        if not (qnames and floats):
            return model, capture
        check = _Capture(folder=folder, tensors=source, quantized=qnames, shapes=shapes, from_folder=False,
                         expect=floats, to_checkpoint=to_checkpoint, transposed=transposed)
        _run(cls, check, hf_arch, metadata=False)
        bad = check.changed(capture.written)
        if not bad:
            return model, capture
        unmapped = [n for n, i in capture.sid.items() if i not in capture.used]
        flip = frozenset(n for n in unmapped if len(shapes[capture.sid[n]]) >= 2) - transposed
        plain = {last for name, last in bad if not chosen and last in unmapped and not name.endswith(".weight")}
        if tries == 2 or not (flip or plain):
            raise check.refusal(*bad[0])
        tries += 1
        transposed |= flip
        keep = [i for i, n in enumerate(qnames) if n not in plain]
        qnames, shapes = [qnames[i] for i in keep], [shapes[i] for i in keep]


def plan_gguf(folder: str | Path, tensors: Mapping[str, Any] | None = None,
              quantized: Callable[[str, tuple[int, ...]], bool] | Sequence[str] | None = None,
              metadata: bool = True, tokenizer_from: str | Path | None = None,
              to_checkpoint: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None
              ) -> GGUFPlan:
    """Run llama.cpp's converter on a float HF ``folder`` (config.json and tokenizer files) and
    return its ``GGUFPlan``.

    ``tensors``: name -> tensor in HF names (default: the folder's safetensors, read lazily);
    only the entries not quantized are read (a quantized one only needs ``.shape``, so meta
    tensors do). ``quantized``: which HF tensors carry lowbit's codes, a predicate on (name,
    shape) or a list of names (default: every tensor of 2 or more axes); each gets a ``RowMap``.
    The names are the checkpoint's (what ``save_pretrained`` writes; an in-memory transformers 5
    MoE with fused experts works where the converter reads fused experts, as Qwen's does).
    ``to_checkpoint``: a function from ``tensors`` (all of them, patterns in place of the
    quantized) to the checkpoint's names, e.g. ``lambda sd: revert_weight_conversion(model, sd)``
    (transformers.core_model_loading) for an in-memory transformers 5 model whose experts are
    fused; the row maps then name ``tensors``' own names. It holds every pattern at once.
    ``metadata=False``: tensors only, the converter's metadata step (tokenizer...) not run.
    ``tokenizer_from``: a GGUF file whose ``tokenizer.*`` keys replace the converter's (a folder
    made from a GGUF by transformers has a tokenizer.json where the original had a SentencePiece
    model, and the converter reads the two differently); the converter's tokenizer step is then
    not run, so the folder needs no tokenizer files.
    FormatError: no converter model for the architecture (naming it), or a quantized tensor
    the converter changes (naming it). LowbitError: the converter is not installed as pinned."""
    from lowbit.files.folder import SafetensorsFolder, read_config

    folder = Path(folder)
    read_config(folder)  # FormatError naming config.json when it is missing or bad
    conv = converter()
    import gguf

    hparams = conv.ModelBase.load_hparams(folder, False)
    hf_arch, cls = model_class(hparams, str(folder / "config.json"))
    source = tensors if tensors is not None else SafetensorsFolder(folder)
    if callable(quantized) or quantized is None:
        pick = quantized or quantized_default
        qnames = [n for n in source if pick(n, _shape(source, n))]
    else:
        unknown = sorted(set(quantized) - set(source))
        if unknown:
            raise FormatError(f"GGUF: tensor {unknown[0]!r} asked to be quantized is not in {str(folder)!r}")
        qnames = [n for n in source if n in set(quantized)]
    shapes = [_shape(source, n) for n in qnames]
    try:
        model, capture = _planned(cls, folder, source, qnames, shapes, hf_arch, metadata, tensors is None,
                                  to_checkpoint, chosen=not (callable(quantized) or quantized is None),
                                  own_vocab=tokenizer_from is None)
    finally:
        if tensors is None:
            source.close()
    kv = {k: v for k, v in model.gguf_writer.kv_data[0].items() if k not in LEFT_TO_WRITER} if metadata else {}
    if metadata and tokenizer_from is not None:
        kv = {k: v for k, v in kv.items() if not k.startswith("tokenizer.")} | gguf_keys(tokenizer_from, "tokenizer.")
    dropped = capture.skipped + [n for n, i in capture.sid.items() if i not in capture.used]
    return GGUFPlan(hf_arch=hf_arch, arch=gguf.MODEL_ARCH_NAMES[cls.model_arch], metadata=kv,
                    tensors=capture.written, dropped=tuple(dict.fromkeys(dropped)))
