"""The decoder-layer loop of a calibrated GGUF run (``LayerLoop``) and GPTQ's queue (``RoundQueue``),
for a model streamed from its shards (``lowbit.gguf_streamed``, whose docstring says how the loop
goes) or already in memory (``lowbit.gguf_resident``): what they are given decides where the
layers come from (``skel``: materialize / release) and where the rows go (``keep``)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from lowbit.calibration.capture import hidden_of
from lowbit.calibration.layer_calls import RealAttributes
from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GgmlType, ImportanceSearch


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


class LayerLoop:
    """The decoder-layer loop of one streamed calibration (module docstring)."""

    def __init__(self, skel, path: str, layers: nn.ModuleList, names: Mapping[str, list[str]],
                 rounds: "RoundQueue", slice_bytes: int, progress: bool | None, recon=None, checkpoint=None,
                 trim: Callable[[], None] = lambda: None) -> None:
        self.skel, self.path, self.layers, self.names, self.slice_bytes = skel, path, layers, names, slice_bytes
        self.rounds, self.progress, self.recon, self.checkpoint = rounds, progress, recon, checkpoint
        self.trim = trim  # returns freed memory to the system after a layer is released
        self.reports: dict[str, dict] = {}  # decoder layer name -> its reconstruction's summary (with ``recon``)

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, batch_size: int) -> None:
        import sys

        from tqdm.auto import tqdm

        from lowbit.calibration.capture import output_hidden, with_hidden
        from lowbit.calibration.layer_calls import capture_calls

        skel, path, layers = self.skel, self.path, self.layers  # what lies outside the layers is loaded
        calls = capture_calls(skel.model, layers, tokens, batch_size)
        skel.release_outside(path)
        self.trim()
        inputs = calls.first
        show = sys.stderr.isatty() if self.progress is None else self.progress
        bar = tqdm(total=len(layers), desc="calibrating GGUF", unit="layer", disable=not show, leave=False,
                   file=sys.stderr)
        last: list = []
        quantized = inputs if self.recon is not None else None  # the quantized model's hidden states
        start = self._resume(inputs)
        if start:
            inputs, quantized = start[1], start[2]
            bar.update(start[0])
        try:
            for i, layer in enumerate(layers):
                if start and i < start[0]:
                    continue
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
                self.trim()
                if i + 1 < len(layers):
                    inputs = [with_hidden(c, output_hidden(o)) for c, o in zip(inputs, outs)]
                    if self.checkpoint is not None and self.rounds.idle():  # every row so far on disk
                        self.checkpoint.save(i + 1, [hidden_of(c) for c in inputs],
                                             None if quantized is None else [hidden_of(c) for c in quantized],
                                             self.rounds.importance, self.reports)
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

    def _resume(self, first: list) -> tuple[int, list, list | None] | None:
        """(the layer to start at, its float and quantized calls) from the checkpoint, the
        importance and summaries so far restored; None: start at the first layer."""
        from lowbit.calibration.capture import with_hidden

        got = None if self.checkpoint is None else self.checkpoint.load()
        if got is None:
            return None
        layer, states, quantized, importance, reports = got
        if len(states) != len(first) or (quantized is None) != (self.recon is None):
            raise QuantizationError(f"{self.checkpoint.state}: the checkpoint does not match this run; delete "
                                    f"{self.checkpoint.spill.folder}")
        self.rounds.importance.update(importance)
        self.reports.update(reports)
        return (layer, [with_hidden(c, h) for c, h in zip(first, states)],
                None if quantized is None else [with_hidden(c, h) for c, h in zip(first, quantized)])

    def _tune(self, layer: nn.Module, prefix: str, inputs: list, targets: list, layout) -> list:
        """Round the layer's linears now and reconstruct them (``lowbit.gguf_reconstruct``) on the
        quantized hidden states ``inputs`` toward the float outputs ``targets``; its outputs on them."""
        from lowbit.gguf_reconstruct import tune_layer

        got: list = []

        def tune(rows: dict) -> dict:
            rows, outs, rep = tune_layer(layer, prefix, rows, self.names, self.rounds.weights, inputs, targets,
                                         self.recon, layout)
            got.append(outs)
            self.reports[prefix.rstrip(".")] = {"mse_start": rep.mse_start, "mse_end": rep.mse_end,
                                                "changed": rep.changed, "weights": rep.weights}
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


class RoundQueue:
    """GPTQ's rounding of the measured linears (``gguf_gptq.round_weights``), queued until the
    queued Hessians and the float weights read from loaded layers reach ``budget`` bytes at the end
    of a group (or twice that within one, or the run ends), then run on one pool, as
    ``gguf_gptq.gptq_sources`` rounds a slice: the workers are not left idle at the end of every
    layer, and after a group that was rounded nothing waits (``idle``: a checkpoint). A group's rows (a decoder layer's, or those of the
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
        if self._bytes >= 2 * self.budget:  # one group's slices past the budget: rounded before it ends
            self.flush()

    def done(self, group: nn.Module, linears: list[str]) -> None:
        self._done.append((id(group), linears))
        # at the group's end, so that the queue is then empty (a checkpoint): past the budget, or
        # when some of the group was rounded already (its slices went past twice the budget)
        if self._bytes >= self.budget or self._rows.get(id(group)):
            self.flush()

    def idle(self) -> bool:
        """Whether every row added so far has been rounded and kept (nothing queued or waiting)."""
        return not self._jobs and not self._done and not any(self._rows.values())

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
