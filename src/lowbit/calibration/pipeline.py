"""Calibrated quantization, one decoder layer at a time.

For each decoder layer, on the inputs captured for it (the quantized outputs of the layer
before; for layer 0, the embeddings):

1. run the float layer once with hooks on one linear of each fused group (q/k/v and gate/up
   read the same input), up to the last of them (``observe_layer``): per-channel max over
   every position (SmoothQuant statistics), the static-scale observer over every position
   except the first ``sink_positions``, and, for GPTQ weight rounding, the input Hessian
   H = sum x^T x over every position (float64, ``lowbit.calibration.hessian``);
2. SmoothQuant (when asked): per mapping, s from alpha (or the alpha search), folded into the
   source and the targets; max observers and Hessians are rescaled exactly
   (H -> diag(1/s) H diag(1/s)), other observers see a second run of the smoothed layer;
3. quantize the layer's linears: weights RTN or GPTQ (one Hessian per fused group; the groups
   of one input width share GPTQ's column loop; NVFP4 weight global scale shared per fused
   group), one static input scale / input global scale per fused group;
4. run the quantized layer to produce the next layer's inputs.

Mixture-of-experts layers (split by ``lowbit.moe.split_experts``): in steps 1 and 2 every expert
runs on every token (``lowbit.moe.all_tokens``), so each expert's statistics and Hessian cover the
whole calibration set, also for an expert that no token routes to; the layer's outputs keep the
real routing. Each expert is its own fused group (its gate/up share scales, experts do not).
SmoothQuant folds through the router (``expand_for_layer``).

Only one layer's inputs are held at a time. Linears outside the decoder layers (lm_head when
asked) are calibrated afterwards with a forward of the whole, already quantized, model.
"""
from __future__ import annotations

import dataclasses
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from lowbit.calibration.layer_calls import capture_calls
from lowbit.calibration.layer_backends import fast_backends as _fast_backends, runs_as_reference as _runs_as_reference
from lowbit.calibration.capture import (
    Inputs, batch_masks, find_decoder_layers, first_window, hidden_of, observe_batches, observing, run_layer,
    with_hidden,
)
from lowbit.dist import Group
from lowbit.errors import QuantizationError
from lowbit.calibration.reduce import check_distributable, check_windows, distinct, reduce_stats, solve_spread
from lowbit.calibration.hooks import InMemory, move_call
from lowbit.calibration.config import CalibrationConfig, LayerInputs
from lowbit.calibration.cost import Phase
from lowbit.calibration.float_states import FloatStates
from lowbit.calibration.observers import make_observer
from lowbit.calibration.outside import before_layers
from lowbit.calibration.stats import CalibrationReport, GroupReport, GroupStats
from lowbit.fusion import fused_groups, shared_weight_global_scales
from lowbit.modules import QuantLinear
from lowbit.moe import all_tokens, same_input_groups
from lowbit.algorithms.gptq import WeightRounding
from lowbit.algorithms.reconstruct import reconstruct_layer
from lowbit.quant.input_scales import input_scales_from_amax
from lowbit.schemes import Scheme
from lowbit.algorithms.smoothquant.mappings import mappings_for, model_type
from lowbit.calibration.smoothing import smooth_layer, smoothing_maps
from lowbit.targets import set_submodule
from lowbit.threads import one_thread


@dataclass
class _RunState:
    """What one ``LayerwiseCalibrator.run`` decided for its layers, passed to each step, and what
    its layer loop carries (``index``, ``float_hidden``)."""

    masks: list[torch.Tensor] | None = None       # per batch [B, T] bool: the positions that count (None: all)
    run_on: torch.device | None = None            # each batch's device when activations are offloaded
    layer_device: torch.device | None = None      # where each layer computes (None: where it is)
    fs_key: tuple | None = None                   # the shared float states' key for this run (None: not used)
    index: int = 0                                # the decoder layer being calibrated
    float_hidden: list[torch.Tensor] | None = None  # the float model's hidden states (reconstruction targets)
    layout: object = None                         # the layer's CallLayout (lowbit.call_layout): where its call holds the windows


class LayerwiseCalibrator:
    """Calibrate and quantize a model's linears layer by layer (see the module's docstring).

    scheme: a ``lowbit.recipes.Assignment`` (a scheme per linear; ``uniform``: one for all), or
        one Scheme for every linear: each fused group is observed, smoothed, rounded (GPTQ options per
        scheme) and given static scales under its own scheme; a decoder layer is reconstructed
        when one of its schemes asks for it (steps: the largest count among them), re-rounding
        the linears of those schemes with the others' codes fixed.
    smoothquant: the resolved alpha (or "auto", or None), or with an Assignment a mapping
        Scheme -> resolved alpha (a mapping's alpha is its targets' scheme's)."""

    def __init__(self, model: nn.Module, scheme, cfg: CalibrationConfig, smoothquant,
                 group: Group | None = None, float_states: FloatStates | None = None, survey=None) -> None:
        self.model = model
        self.survey = survey  # a LayerSurvey: targets decided per loaded layer (streamed), or None
        self.float_states = float_states  # shared float hidden states (lowbit.calibration.float_states)
        self.group = group or Group.single()  # ranks sharing the calibration batches (lowbit.dist)
        if isinstance(scheme, Scheme):  # one scheme for whatever linears run() is given
            self.assign, self.uniform, schemes = {}, scheme, [scheme]
        else:  # a lowbit.recipes.Assignment
            self.assign, self.uniform, schemes = scheme, scheme.uniform, scheme.distinct
        self.cfg = cfg
        self.alphas = dict(smoothquant) if isinstance(smoothquant, dict) else {s: smoothquant for s in schemes}
        smoothquant = next((a for a in self.alphas.values() if a is not None), None)
        self.smoothquant = smoothquant
        self.smoothing = smoothquant is not None
        # the family table: only where a layer's data flow cannot be read (smoothing_maps)
        self.table = mappings_for(model, include_mlp_inner=cfg.smooth_down_proj) if self.smoothing else None
        family = model_type(model)
        check_distributable(self.group, cfg, smoothquant)
        self.inputs = cfg.inputs_for_all(schemes)
        roundings = {s: cfg.rounding_for(s) for s in schemes}
        gptq = [s for s in schemes if roundings[s] is WeightRounding.GPTQ]
        label = "+".join(s.name for s in schemes)
        rounding = "+".join(dict.fromkeys(r.value for r in roundings.values()))
        self.report = CalibrationReport(label, 0, cfg.seq_len, cfg.sink_positions, cfg.observer,
                                        smoothquant if self.uniform is not None else
                                        {s.name: a for s, a in self.alphas.items()},
                                        family if self.smoothing else None,
                                        weight_rounding=rounding,
                                        gptq=dataclasses.asdict(cfg.gptq_options(gptq[0])) if gptq else None,
                                        layer_inputs=self.inputs.value)

    # ------------------------------------------------------------------ per-linear schemes
    def _scheme(self, name: str) -> Scheme:
        """The scheme of linear ``name`` (its full name in the model)."""
        return self.uniform if self.uniform is not None else self.assign[name]

    def _gptq(self, scheme: Scheme) -> bool:
        return self.cfg.rounding_for(scheme) is WeightRounding.GPTQ

    def _reconstructs(self, names: list[str]):
        """The reconstruction options for a layer of these linears (None: off) and the names it
        re-rounds: the linears whose scheme asks for steps; the most steps among them."""
        asked = [(self.cfg.reconstruct_iters_for(self._scheme(n)), n) for n in names]
        asked = [(k, n) for k, n in asked if k > 0]
        if not asked:
            return None, []
        top = max(asked, key=lambda kn: kn[0])
        return self.cfg.reconstruct_options(self._scheme(top[1])), [n for _, n in asked]

    # ------------------------------------------------------------------ helpers
    def _new_stats(self, name: str) -> GroupStats:
        """Statistics for the input of the group that linear ``name`` heads, under its scheme."""
        scheme = self._scheme(name)
        spec = scheme.input_activations
        obs = None
        if scheme.needs_calibration:
            obs = make_observer(self.cfg.observer, spec, percentile=self.cfg.percentile,
                                max_rows=self.cfg.max_sample_rows)
        rows = self.cfg.max_sample_rows if self.alphas.get(scheme) == "auto" else 0
        return GroupStats(obs, rows, hessian=self._gptq(scheme), deferred_hessian=self.group.rank > 0)

    def _observe_pass(self, root: nn.Module, groups: list[list[str]], inputs: Inputs,
                      stats: dict[str, GroupStats], rel: dict[str, str], run: _RunState,
                      outputs: bool = False) -> list[torch.Tensor] | None:
        """Observe the groups' inputs; with ``outputs`` the layer runs to its end and its outputs
        are returned (the next layer's inputs under layer_inputs="float")."""
        mods = {g[0]: root.get_submodule(rel[g[0]]) for g in groups}
        sinks = self.cfg.sink_positions
        seq = hidden_of(inputs[0]).shape[-2] if inputs and hidden_of(inputs[0]).dim() >= 3 else 0
        # every expert observes every token; the routing of the outputs is kept
        with all_tokens(root), self.report.cost.timed(Phase.OBSERVE, len(inputs)):
            return observe_batches(root, inputs, mods, lambda n, x, m: stats[n].observe(x, sinks, seq, m),
                                   run.masks, run.run_on, outputs)

    def _quantize_groups(self, root: nn.Module, groups: list[list[str]], rel: dict[str, str],
                         stats: dict[str, GroupStats] | None) -> None:
        solve: dict[Scheme, list] = {}  # per scheme: (linears, weight global scales, input scales, Hessian)
        for g in groups:
            scheme = self._scheme(g[0])
            lins = {n: root.get_submodule(rel[n]) for n in g}
            gscales = shared_weight_global_scales({n: m.weight for n, m in lins.items()}, scheme)
            sc: dict[str, torch.Tensor] = {}
            rep = self.report.groups.setdefault(g[0], GroupReport(members=list(g)))
            if stats is not None and g[0] in stats:
                st = stats[g[0]]
                try:
                    rep.amax_all = float(st.all_pos.amax().amax())
                    amax = st.scale_amax() if scheme.needs_calibration else None
                except ValueError as e:  # the observer saw nothing: the forward never reached it
                    raise QuantizationError(
                        f"linear {g[0]!r} saw no calibration input: the model's forward on the calibration "
                        f"tokens never calls it (add it to ignore to keep it in float)") from e
                if scheme.needs_calibration:
                    rep.amax_used = float(amax)
                    sc = input_scales_from_amax(scheme.input_activations, amax)
            st = stats[g[0]] if self._gptq(scheme) and stats is not None and g[0] in stats else None
            if st is None or st.hessian_sum is None or (not self.group.distributed and st.hessian_upper is None):
                for n, lin in lins.items():
                    q = QuantLinear.from_linear(lin, scheme, name=n, weight_global_scale=gscales.get(n), **sc)
                    set_submodule(root, rel[n], q)
                continue
            solve.setdefault(scheme, []).append((lins, gscales, sc, st))
        for scheme, items in solve.items():
            cores = torch.get_num_threads()
            with one_thread():  # every group at once: groups of one input width share the column loop, and
                #                 the loops of other widths run beside it on the other cores
                qts = solve_spread(self.group, [[m.weight for m in lins.values()] for lins, _, _, _ in items],
                                   [st for _, _, _, st in items], scheme.weights,
                                   global_scales=[[gs.get(n) for n in lins] for lins, gs, _, _ in items],
                                   options=self.cfg.gptq_options(scheme),
                                   names=[[f"{n}.weight" for n in lins] for lins, _, _, _ in items],
                                   workers=cores)
            for (lins, _, sc, _), group_qts in zip(items, qts):
                for (n, lin), qt in zip(lins.items(), group_qts):
                    q = QuantLinear.from_quantized(qt, scheme, lin.bias, name=n, dtype=lin.weight.dtype, **sc)
                    set_submodule(root, rel[n], q)

    # ------------------------------------------------------------------ main
    @torch.no_grad()
    def run(self, tokens: torch.Tensor, names: list[str], progress: bool | None = None,
            hooks: InMemory | None = None, valid: torch.Tensor | None = None) -> CalibrationReport:
        """Calibrate and quantize ``names`` layer by layer on ``tokens``; ``progress``: a bar per
        decoder layer on stderr (None: when stderr is a terminal). ``hooks``
        (``lowbit.calibration.hooks``): what happens around each decoder layer (default: nothing,
        the model is in memory; ``lowbit.streamed`` loads and writes each layer). ``valid`` [n, T]:
        the positions that count (padding: no statistic or loss sees the others; None: all)."""
        from tqdm.auto import tqdm

        hooks = hooks or InMemory()
        t0 = time.perf_counter()
        run = _RunState(masks=batch_masks(valid, tokens, self.cfg.batch_size),
                        run_on=hooks.device if hooks.offload else None, layer_device=hooks.device)
        fs = self.float_states
        if fs is not None and not self.smoothing and not self.group.distributed and not hooks.offload:
            key = fs.make_key(tokens, valid, self.cfg.batch_size)
            run.fs_key = key if fs.matches(key) else None
        self.report.num_samples = int(tokens.shape[0])
        check_windows(self.group, tokens.shape[0], self.cfg.seq_len)  # several ranks: this rank's windows
        found = find_decoder_layers(self.model, names)
        done: set[str] = set()
        if found is not None:
            path, layers = found
            first, saved = hooks.start(path, layers)
            with self.report.cost.timed(Phase.CAPTURE):
                calls = capture_calls(self.model, layers, tokens, self.cfg.batch_size)
            inputs = calls.first
            outside = [n for n in names if not n.startswith(path + ".")]
            if outside and not hooks.whole_model:  # streamed: before the layers run (calibration.outside)
                before_layers(self, outside, tokens, layers[0], run.masks)
                done.update(outside)
            hooks.captured()
            # block reconstruction on quantized layer inputs aims at the float model's outputs:
            # the float model's hidden states are carried along (the float inputs otherwise are them)
            quantized_inputs = self.inputs is LayerInputs.QUANTIZED
            if quantized_inputs and self._reconstructs(names)[0] is not None:
                run.float_hidden = [hidden_of(c) for c in inputs]
            if saved is not None:  # a resumed run: the hidden states entering layer `first`
                n = len(inputs)
                inputs = [with_hidden(c, h) for c, h in zip(inputs, saved[:n])]
                if run.float_hidden is not None:
                    run.float_hidden = list(saved[n:])
            if hooks.device is not None and not hooks.offload:
                inputs = [move_call(c, hooks.device) for c in inputs]
            show = sys.stderr.isatty() if progress is None else progress
            bar = tqdm(total=len(layers), initial=first, desc=f"calibrating {self.report.scheme}", unit="layer",
                       disable=not show, leave=False, file=sys.stderr)
            for i in range(first, len(layers)):
                layer = layers[i]
                prefix = f"{path}.{i}."
                lnames = [n for n in names if n.startswith(prefix)]
                more = i + 1 < len(layers)
                run.index = i
                inputs = calls.for_layer(i, inputs, hooks.device if not hooks.offload else None)
                run.layout = calls.layout(i)
                hooks.enter(i, layer)
                if lnames and self.survey is not None:
                    lnames = self.survey.check(layer, prefix, lnames, first_window(inputs, run.run_on, run.layout),
                                               self.group)
                if lnames:
                    outs = self._layer(layer, prefix, lnames, inputs, run, more)
                else:
                    outs = self._next_inputs(layer, inputs, run) if more else None
                if more:
                    inputs = [with_hidden(c, o) for c, o in zip(inputs, outs)]
                if not lnames and run.float_hidden is not None:
                    run.float_hidden = self._float_outputs(layer, inputs, run)
                carried = [hidden_of(c) for c in inputs] + (run.float_hidden or [])
                hooks.leave(i, layer, carried if more else None)
                bar.update(1)
            done.update(n for n in names if n.startswith(path + "."))
            bar.close()
            del inputs
        elif self.smoothing:
            warnings.warn("lowbit: no decoder layers found; the model is calibrated as a whole, without "
                          "SmoothQuant", stacklevel=3)
        rest = [n for n in names if n not in done]
        if rest:
            self._whole_model(rest, tokens, run.masks)
        self.report.seconds = time.perf_counter() - t0
        return self.report

    def _next_inputs(self, layer: nn.Module, inputs: Inputs, run: _RunState) -> list[torch.Tensor]:
        """The (quantized) layer's outputs on ``inputs``: the next layer's inputs."""
        with _fast_backends(layer), self.report.cost.timed(Phase.NEXT_INPUTS, len(inputs)):
            return run_layer(layer, inputs, run.run_on)

    def _layer(self, layer: nn.Module, prefix: str, lnames: list[str], inputs: Inputs, run: _RunState,
               more: bool) -> list[torch.Tensor] | None:
        """Calibrate and quantize one layer; return the hidden states the next layer takes (None
        for the last layer, ``more`` False): under ``layer_inputs="float"`` the float layer's
        outputs (computed by the observe pass, before smoothing, which leaves them unchanged); else
        the quantized layer's, as ``run_layer`` gives them (those reconstruction computed, when the
        layer's backends match the reference: the same bits)."""
        outputs = self.inputs is LayerInputs.FLOAT and more
        rel = {n: n[len(prefix):] for n in lnames}
        groups = fused_groups(lnames)
        rep = same_input_groups(layer, [[rel[n] for n in g] for g in groups], [g[0] for g in groups])
        heads = [g for g in groups if rep.get(g[0], g[0]) == g[0]]  # one observed group per input
        stats = {g[0]: self._new_stats(g[0]) for g in heads}
        for g in groups:
            stats[g[0]] = stats[rep.get(g[0], g[0])]  # the same object: one Hessian, one observer
        outs = self._observe_pass(layer, heads, inputs, stats, rel, run, outputs=outputs)
        # several ranks: what one process observes (a rank holding no batch observed on the layer's device)
        reduce_stats(self.group, distinct(stats), next(layer.parameters()).device)
        if self.smoothing:
            with self.report.cost.timed(Phase.SMOOTH):
                maps = smoothing_maps(layer, prefix, list(rel.values()), first_window(inputs, run.run_on, run.layout),
                                      self.table, self.cfg.smooth_down_proj, self.report, self.group)
                stale = smooth_layer(layer, rel, groups, stats, maps, self._scheme, self.alphas,
                                     self.report.groups, self.cfg.auto_alphas)
            if stale:
                fresh = {k: self._new_stats(k) for k in stale}
                self._observe_pass(layer, [g for g in heads if g[0] in fresh], inputs, fresh, rel, run)
                for g in groups:
                    head = rep.get(g[0], g[0])
                    if head in fresh:
                        stats[g[0]] = fresh[head]
        recon, rounded = self._reconstructs(lnames)
        if recon is not None:  # the float layer's weights and outputs, before quantization
            floats = {rel[n]: layer.get_submodule(rel[n]).weight.detach() for n in rounded}
            if run.float_hidden is not None:  # the float layer on the float model's hidden states
                targets = run.float_hidden = self._float_outputs(layer, inputs, run)
            elif outs is not None:
                targets = outs
            else:
                with self.report.cost.timed(Phase.TARGETS, len(inputs)):
                    targets = run_layer(layer, inputs, run.run_on)
        elif run.float_hidden is not None:  # not reconstructed (mixed recipes): the float states advance
            run.float_hidden = self._float_outputs(layer, inputs, run)
        with self.report.cost.timed(Phase.QUANTIZE):
            self._quantize_groups(layer, groups, rel, stats)
        if run.layer_device is not None:
            layer.to(run.layer_device)  # the quantized linears are built where their weights were
        if recon is not None:
            r = reconstruct_layer(layer, targets, floats, inputs, recon, set_submodule, run.run_on, self.group,
                                  masks=run.masks, layout=run.layout)
            cost = self.report.cost
            cost.add(Phase.RECONSTRUCT_STEPS, r.step_seconds, r.steps)
            cost.add(Phase.RECONSTRUCT_EVALS, r.eval_seconds, r.eval_calls)
            cost.backward_calls += r.backward_calls
            self.report.reconstruct[prefix.rstrip(".")] = {"mse_start": r.mse_start, "mse_end": r.mse_end,
                                                           "changed": r.changed, "weights": r.weights,
                                                           "scales_changed": r.scales_changed, "history": r.history,
                                                           "best_step": r.best_step, "check_start": r.check_start,
                                                           "check_end": r.check_end}
            if more and outs is None and r.outputs is not None and _runs_as_reference(layer):
                # the outputs of the codes kept, as the layer's backends compute them: the next inputs
                cost.reused_outputs += 1
                return [o.to(hidden_of(c).device) for o, c in zip(r.outputs, inputs)]
        if not more:
            return None
        return outs if outs is not None else self._next_inputs(layer, inputs, run)

    def _float_outputs(self, layer: nn.Module, inputs: Inputs, run: _RunState) -> list[torch.Tensor]:
        """The (still float) layer's outputs on the float model's hidden states (those of
        ``float_states`` when they hold this layer's for this run's key; else computed, and
        kept there when given)."""
        key, fs = run.fs_key, self.float_states
        if key is not None and (kept := fs.get(run.index)) is not None:
            self.report.cost.reused_float_states += 1
            return kept
        calls = [with_hidden(c, h) for c, h in zip(inputs, run.float_hidden)]
        with _fast_backends(layer), self.report.cost.timed(Phase.TARGETS, len(calls)):
            outs = run_layer(layer, calls, run.run_on)
        if key is not None:
            fs.put(key, run.index, outs)
        return outs

    def _whole_model(self, names: list[str], tokens: torch.Tensor, masks: list[torch.Tensor] | None) -> None:
        """Linears outside the decoder layers: observe during full forwards (``masks``: per batch,
        the positions that count), then quantize."""
        groups = fused_groups(names)
        rel = {n: n for n in names}
        stats = None
        t0 = time.perf_counter()
        if any(self._scheme(n).needs_calibration or self._gptq(self._scheme(n)) for n in names):
            stats = {g[0]: self._new_stats(g[0]) for g in groups}
            mods = {g[0]: self.model.get_submodule(g[0]) for g in groups}
            device = next(self.model.parameters()).device
            sinks, bs, current = self.cfg.sink_positions, self.cfg.batch_size, [None]  # current: the batch's mask
            with observing(mods, lambda n, x: stats[n].observe(x, sinks, 0, current[0])), \
                    _fast_backends(self.model), all_tokens(self.model):
                for b, i in enumerate(range(0, tokens.shape[0], bs)):
                    current[0] = None if masks is None else masks[b]
                    self.model(input_ids=tokens[i:i + bs].to(device), use_cache=False)
        self._quantize_groups(self.model, groups, rel, stats)
        self.report.cost.add(Phase.WHOLE_MODEL, time.perf_counter() - t0)
