"""A calibrated GGUF file's importance matrix and GPTQ, one decoder layer in memory at a time.

``lowbit.quantize_gguf(folder, out, "Q4_K_M", calibration=...)`` runs here: the model is built
without weights (``lowbit.streamed.skeleton.Skeleton``), the first decoder layer's calls are
captured with the embeddings loaded (``lowbit.calibration.layer_calls.capture_calls``), and then,
layer by layer, the layer is read from the shards, run on the float hidden states of every
calibration batch while its linears' statistics are gathered (``InputStatistics``: llama-imatrix's
mean squared input per column and GPTQ's Hessians), its weights rounded (``gguf_gptq.round_weights``)
and written to a spill folder, and the layer freed; its float outputs are the next layer's inputs.
The linears outside the layers (the output head; any before the layers) are measured last by the
model's own forward with every layer replaced by a stand-in that passes the hidden states on, the
last one handing over the float outputs the last real layer computed (``_Replay``): the head sees
the model's own final norm of them, and the logits are never computed.

Every linear sees what it sees in the in-memory pass (``gguf_gptq.gptq_sources``: the float model,
batch by batch, the same windows), so the importance vectors, Hessians and rows are the same and the
file is the same, byte for byte (tests against ``lowbit.quantize`` + ``lowbit.save`` in memory).
Memory holds the embeddings (during the capture and the last pass), one decoder layer, the
calibration hidden states, the importance vectors and the Hessians waiting for GPTQ: they queue
up to ``QUEUE_BYTES`` (1 GiB) and are then rounded on one pool (``_Rounds``: rounding each layer
alone left the workers idle at the end of every layer, +35% of GPTQ's time on SmolLM2-135M); a
layer whose Hessians exceed ``gguf_gptq.MAX_HESSIAN_BYTES`` (4 GiB, the in-memory pass's bound) is
measured in slices, one more run of the layer each. The encoded rows wait on disk (``Spill``,
about the output file's size) until the writer takes them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.nn as nn

from lowbit.calibration.capture import hidden_of
from lowbit.calibration.layer_calls import RealAttributes
from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GgmlType, ImportanceSearch


class Spill(MutableMapping):
    """HF weight name -> (GGML type, uint8 rows), the rows kept in files of a folder and read back
    memory-mapped (copy on write: the file is never changed), as ``write_gguf``'s ``encoded``
    takes them. ``close()`` removes the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._items: dict[str, tuple[GgmlType, tuple[int, ...], Path]] = {}

    @classmethod
    def beside(cls, out: Path) -> "Spill":
        """A new spill folder next to the output file ``out`` (a hidden temporary name)."""
        return cls(Path(tempfile.mkdtemp(prefix=f".{out.name}.rows-", dir=out.parent)))

    def __setitem__(self, name: str, value: tuple[GgmlType, torch.Tensor]) -> None:
        kind, rows = value
        rows = torch.as_tensor(rows)
        if rows.dtype != torch.uint8:
            raise TypeError(f"{name}: encoded rows must be uint8, got {rows.dtype}")
        path = self.folder / f"{len(self._items)}-{abs(hash(name)) % 10**8}.bin"
        rows.contiguous().numpy().tofile(path)
        self._items[name] = (kind, tuple(rows.shape), path)

    def __getitem__(self, name: str) -> tuple[GgmlType, torch.Tensor]:
        kind, shape, path = self._items[name]
        if not all(shape):
            return kind, torch.empty(shape, dtype=torch.uint8)
        return kind, torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=shape))

    def __delitem__(self, name: str) -> None:
        del self._items[name]  # the file goes with the folder

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        self._items.clear()
        shutil.rmtree(self.folder, ignore_errors=True)


class _Replay(RealAttributes):
    """Stands in for a decoder layer in the last pass: returns the hidden states it got (in the
    form the real layer's output has: ``template``), or, for the last layer (``given``: its real
    outputs per batch), the next batch's real output. Other attributes are the real layer's."""

    def __init__(self, layer: nn.Module, template: Any, given: list | None, loop: list[bool]) -> None:
        super().__init__(layer)
        object.__setattr__(self, "_given", given)
        self.template, self.loop, self.batch = template, loop, 0

    def forward(self, *args, **kwargs):
        given = object.__getattribute__(self, "_given")
        if given is not None:
            self.loop[0] = False
            out = given[self.batch]
            self.batch += 1
            return out
        self.loop[0] = True
        h = hidden_of((args, kwargs))
        t = self.template
        return (h,) + tuple(t[1:]) if isinstance(t, (tuple, list)) else h


class _Layers:
    """The decoder-layer loop of one streamed calibration (module docstring)."""

    def __init__(self, skel, path: str, layers: nn.ModuleList, names: Mapping[str, list[str]],
                 rounds: "_Rounds", slice_bytes: int, progress: bool | None, recon=None) -> None:
        self.skel, self.path, self.layers, self.names, self.slice_bytes = skel, path, layers, names, slice_bytes
        self.rounds, self.progress, self.recon = rounds, progress, recon
        self.reports: dict[str, Any] = {}  # decoder layer name -> its ReconstructReport (with ``recon``)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, batch_size: int) -> None:
        import sys

        from tqdm.auto import tqdm

        from lowbit.calibration.capture import output_hidden, with_hidden
        from lowbit.calibration.layer_calls import capture_calls
        from lowbit.streamed.stream import trim_heap

        skel, path, layers = self.skel, self.path, self.layers  # what lies outside the layers is loaded
        calls = capture_calls(skel.model, layers, tokens, batch_size)
        skel.release_outside(path)
        trim_heap()
        inputs = calls.first
        show = sys.stderr.isatty() if self.progress is None else self.progress
        bar = tqdm(total=len(layers), desc="calibrating GGUF", unit="layer", disable=not show, leave=False,
                   file=sys.stderr)
        last: list = []
        quantized = inputs if self.recon is not None else None  # the quantized model's hidden states
        try:
            for i, layer in enumerate(layers):
                inputs = calls.for_layer(i, inputs)
                skel.materialize(layer, f"{path}.{i}")
                prefix = f"{path}.{i}."
                outs = self._measure(layer, [n for n in self.names if n.startswith(prefix)], inputs)
                if quantized is not None:
                    quantized = calls.for_layer(i, quantized)
                    q_outs = self._tune(layer, prefix, quantized, [output_hidden(o) for o in outs],
                                        calls.layout(i))
                    quantized = [with_hidden(c, h) for c, h in zip(quantized, q_outs)]
                skel.release(layer)
                trim_heap()
                if i + 1 < len(layers):
                    inputs = [with_hidden(c, output_hidden(o)) for c, o in zip(inputs, outs)]
                else:
                    last = outs
                bar.update(1)
        finally:
            bar.close()
        del inputs
        outside = [n for n in self.names if not n.startswith(path + ".")]
        if outside:
            self._outside(outside, tokens, batch_size, last)
        self.rounds.flush()

    def _tune(self, layer: nn.Module, prefix: str, inputs: list, targets: list, layout) -> list:
        """Round the layer's linears now and reconstruct them (``lowbit.gguf_reconstruct``) on the
        quantized hidden states ``inputs`` toward the float outputs ``targets``; its outputs on them."""
        from lowbit.gguf_reconstruct import tune_layer

        got: list = []

        def tune(rows: dict) -> dict:
            rows, outs, rep = tune_layer(layer, prefix, rows, self.names, self.rounds.weights, inputs, targets,
                                         self.recon, layout)
            got.append(outs)
            self.reports[prefix.rstrip(".")] = rep
            return rows

        self.rounds.flush(tune)
        return got[0]

    def _measure(self, root: nn.Module, linears: list[str], inputs: list) -> list:
        """Run ``root`` (a decoder layer) on every call of ``inputs``, once per slice of ``linears``
        whose Hessians fit ``slice_bytes``, each slice's statistics handed to the rounds; the
        outputs of the last run (every call's, whole)."""
        from lowbit.calibration.importance import InputStatistics
        from lowbit.gguf_gptq import slices

        model = self.skel.model
        outs: list = []
        for part in slices(model, linears, self.slice_bytes) or [[]]:
            stats = InputStatistics({n: model.get_submodule(n) for n in part}, hessians=True)
            outs = []
            with stats.observing():
                for args, kwargs in inputs:
                    stats.next_batch()
                    outs.append(root(*args, **kwargs))
            self.rounds.add(root, part, *stats.result(unseen=1.0))
            del stats
        self.rounds.done(root, linears)
        return outs

    def _outside(self, outside: list[str], tokens: torch.Tensor, batch_size: int, last: list) -> None:
        """The linears outside the decoder layers, measured by the model's forward on stand-ins."""
        from lowbit.calibration.capture import Stop
        from lowbit.calibration.importance import InputStatistics

        skel, layers, model = self.skel, self.layers, self.skel.model
        skel.materialize_outside(self.path)
        loop = [False]
        real = list(layers)
        template = last[0] if last else None
        stats = InputStatistics({n: model.get_submodule(n) for n in outside}, hessians=True)

        def inside(module, args):
            if loop[0]:
                name = next(n for n, m in stats.linears.items() if m is module)
                raise QuantizationError(f"linear {name!r} lies outside the decoder layers but runs inside their "
                                        f"loop; a streamed calibration cannot measure it")

        def stop(module, args):
            raise Stop

        head = getattr(model, "get_output_embeddings", lambda: None)()
        try:
            for i in range(len(layers)):
                layers[i] = _Replay(real[i], template, last if i == len(layers) - 1 else None, loop)
            checks = [m.register_forward_pre_hook(inside) for m in stats.linears.values()]
            with stats.observing():
                if isinstance(head, nn.Module):  # after the observers: the head's own input is measured first
                    checks.append(head.register_forward_pre_hook(stop))
                try:
                    for s in range(0, tokens.shape[0], batch_size):
                        stats.next_batch()
                        try:
                            model(input_ids=tokens[s:s + batch_size], use_cache=False)
                        except Stop:
                            pass
                finally:
                    for h in checks:
                        h.remove()
        finally:
            for i in range(len(layers)):
                layers[i] = real[i]
        self.rounds.add(model, outside, *stats.result(unseen=1.0))
        self.rounds.done(model, outside)


#: the Hessians (and weights of loaded layers) queued for GPTQ before it rounds them: small enough
#: to keep a streamed run's memory well below a large model's (a random 0.4B-parameter Llama of 24
#: layers, 1.66 GB in float32: peak RSS 8.2 GB with a 4 GiB queue, 4.8 GB with this one, 7.6 GB
#: in memory; bench/gguf/RESULTS-gguf.md), large enough that one pool rounds many layers at once
QUEUE_BYTES = 1 << 30


class _Rounds:
    """GPTQ's rounding of the measured linears (``gguf_gptq.round_weights``), queued until the
    queued Hessians and the float weights read from loaded layers reach ``budget`` bytes (or the
    run ends), then run on one pool, as ``gguf_gptq.gptq_sources`` rounds a slice: the workers are
    not left idle at the end of every layer. A group's rows (a decoder layer's, or those of the
    linears outside the layers) are handed to ``keep(rows, linears)`` once the group is done and
    rounded. ``importance``: HF weight name -> vector, filled as linears are added."""

    def __init__(self, names: Mapping[str, list[str]], kinds: Mapping[str, GgmlType], weights: Callable,
                 from_model: set[str], keep: Callable, options, search: ImportanceSearch, budget: int) -> None:
        self.names, self.kinds, self.weights, self.from_model = names, kinds, weights, from_model
        self.keep, self.options, self.search, self.budget = keep, options, search, budget
        self.importance: dict[str, torch.Tensor] = {}
        self._jobs: list[tuple[str, str]] = []
        self._imp: dict[str, torch.Tensor] = {}
        self._hess: dict[str, Any] = {}
        self._held: dict[str, torch.Tensor] = {}  # weights of loaded layers, read before the layer is released
        self._bytes = 0
        self._group_of: dict[str, int] = {}  # HF weight name -> its group's id
        self._rows: dict[int, dict] = {}
        self._done: list[tuple[int, list[str]]] = []

    def add(self, group: nn.Module, linears: list[str], imp: dict, hess: dict) -> None:
        for n in linears:
            for w in self.names[n]:
                self.importance[w] = imp[n]
        jobs = [(w, n) for n in linears for w in self.names[n] if w in self.kinds]
        seen: set[int] = set()
        for w, n in jobs:
            self._group_of[w] = id(group)
            self._imp[n] = imp[n]
            if n in hess:
                self._hess[n] = hess[n]
                if id(hess[n]) not in seen:
                    seen.add(id(hess[n]))
                    self._bytes += 8 * imp[n].numel() ** 2
            if w in self.from_model:
                self._held[w] = t = self.weights(w).detach()  # not the parameter: released to meta with its layer
                self._bytes += t.numel() * t.element_size()
        self._jobs += jobs
        self._rows.setdefault(id(group), {})
        if self._bytes >= self.budget:
            self.flush()

    def done(self, group: nn.Module, linears: list[str]) -> None:
        self._done.append((id(group), linears))

    def flush(self, tune: Callable[[dict], dict] | None = None) -> None:
        """Round what is queued; each done group's rows to ``keep`` (through ``tune`` when given:
        rows -> rows, called once, for the one group done)."""
        from lowbit.gguf_gptq import round_weights

        if self._jobs:
            held = self._held
            got = round_weights(self._jobs, lambda w: held[w] if w in held else self.weights(w), self.kinds,
                                self._imp, self._hess, options=self.options, search=self.search)
            for w, v in got.items():
                self._rows[self._group_of[w]][w] = v
        self._jobs, self._imp, self._hess, self._held, self._bytes = [], {}, {}, {}, 0
        if tune is not None and len(self._done) != 1:
            raise AssertionError(f"a tuned flush rounds one group, {len(self._done)} are done")
        for group, linears in self._done:
            rows = self._rows.pop(group, {})
            self.keep(rows if tune is None else tune(rows), linears)
        self._done = []


def _keep(plan, names, parts, importance: dict, spill: Spill, got: dict, linears: list[str]) -> None:
    """A group's rows into ``spill``, experts stored fused stacked first (``gguf_fused.stack``)."""
    from lowbit.gguf_fused import stack

    mine = {w: p for w, p in parts.items() if any(w in names[n] for n in linears)}
    if mine:
        stack(plan, mine, importance, got)
    for w, v in got.items():
        spill[w] = v


def streamed_sources(src: Path, plan, tokens: torch.Tensor, config, kinds: Mapping[str, GgmlType],
                     search: ImportanceSearch, spill: Spill, progress: bool | None = None,
                     max_hessian_bytes: int | None = None) -> dict[str, torch.Tensor] | None:
    """HF weight name -> llama-imatrix's vector for every linear (stacked [E, in] for experts stored
    fused), the rows GPTQ rounded for the weights of ``kinds`` put in ``spill`` (HF weight name ->
    (type, rows), as ``gguf_gptq.gptq_sources`` gives them; experts stored fused stacked per
    tensor, ``lowbit.gguf_fused``), from the calibration windows ``tokens`` run through the model of
    the folder ``src`` one decoder layer at a time (module docstring). ``config``: the
    CalibrationConfig (batch size, GPTQ's options). None when the model has no decoder layers to
    stream (the caller runs it in memory). ``max_hessian_bytes``: the most Hessian bytes one run of a layer
    gathers (None: ``gguf_gptq.MAX_HESSIAN_BYTES``, as in memory; the queue is the smaller of it
    and ``QUEUE_BYTES``)."""
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.files.folder import SafetensorsFolder
    from lowbit.gguf_fused import fused_parts, with_parts
    from lowbit.gguf_reconstruct import reconstruct_options
    from lowbit.gguf_gptq import (MAX_HESSIAN_BYTES, checkpoint_keys, gptq_options, model_sources, source_weights,
                                  weight_names)
    from lowbit.moe.naming import stored_key
    from lowbit.streamed.skeleton import Skeleton

    skel = Skeleton.open(src)
    try:
        model = skel.model
        keys = set(skel.ckpt.tensors)
        found = find_decoder_layers(model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
        if found is None:
            return None
        skel.materialize_outside(found[0])  # the capture's; ties the output embedding, which the names see
        disk = checkpoint_keys(model, keys, skel.renames)
        names = weight_names(model, disk)
        parts = fused_parts(model, [w for ws in names.values() for w in ws],
                            lambda k: stored_key(skel.model_type, k, keys, skel.renames))
        bound = MAX_HESSIAN_BYTES if max_hessian_bytes is None else max_hessian_bytes
        rounds = _Rounds(names, with_parts(kinds, parts),
                         source_weights(model, SafetensorsFolder(src), plan, parts, disk), model_sources(plan, parts),
                         lambda got, linears: _keep(plan, names, parts, importance, spill, got, linears),
                         gptq_options(config), search, min(QUEUE_BYTES, bound))
        importance = rounds.importance
        _Layers(skel, found[0], found[1], names, rounds, bound, progress,
                reconstruct_options(config)).run(tokens, config.batch_size)
        return importance
    finally:
        skel.close()
