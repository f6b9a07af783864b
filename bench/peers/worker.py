"""One tool, one scheme, one model: quantize in memory, time it, measure peak RSS, perplexity and
the KL divergence from the float model (its hidden states kept before quantizing).

Runs inside each tool's own virtual environment (it imports only torch, transformers,
safetensors and the tool), so it must not import lowbit unless the tool is lowbit. The
evaluation token ids come from the driver (run_peers.py) in a safetensors file, so every tool
scores exactly the same windows with the same code (full logits: fine for a 49k vocabulary).

    python worker.py --tool TOOL --model DIR --scheme SCHEME --ids ids.safetensors --window 512 --out r.json \
        [--calib-ids calib.safetensors] [--layers N] [--iters N] [--threads N]

--layers N quantizes only decoder layers 0..N-1 in every tool (the others stay float); --iters is
the tuning length of the tools that tune (auto-round-tuned, lowbit-best-iters). --calib-ids holds
the calibration token windows [16, 256] the driver cut with lowbit's rule (evenly spaced windows
of the whole calibration file): the tuned tools calibrate on exactly these tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
import traceback


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class PeakRSS:
    """Samples VmRSS every 5 ms in a thread: the peak while a block runs (ru_maxrss would
    include the model load before it)."""

    def __enter__(self):
        import threading

        self.peak = rss_mb()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb())


def perplexity(model, ids, window: int) -> tuple[float, int]:
    """Non-overlapping windows; each scores window-1 tokens (as lowbit.eval.perplexity)."""
    import torch

    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, window):
            chunk = ids[s:s + window][None]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1)
            nll -= float(lp.gather(-1, chunk[0, 1:, None]).sum())
            n += chunk.shape[1] - 1
    return math.exp(nll / n), n


def float_reference(model, ids, window: int):
    """The float model's final hidden states at the scored positions of ``perplexity``'s windows and a
    copy of its output head's weight (and bias): the float distribution of every scored token,
    recomputed exactly when the KL divergence is taken (lowbit.eval.reference's rule, in torch
    only: this file runs in the peers' environments)."""
    import torch

    hs = []
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, window):
            chunk = ids[s:s + window][None]
            if chunk.shape[1] < 2:
                break
            hs.append(model.get_decoder()(input_ids=chunk, use_cache=False).last_hidden_state[0, :-1].float())
        head = model.get_output_embeddings()
        bias = None if head.bias is None else head.bias.detach().float().clone()
    return torch.cat(hs), head.weight.detach().float().clone(), bias


def kl_divergence(model, ids, window: int, ref) -> dict:
    """KL(float || model) per token, natural log, full vocabulary, over ``perplexity``'s scored
    tokens: mean, batch-means 95% half width (32 blocks, t quantile as lowbit.eval.intervals),
    p99, max, and the share of tokens whose top token is the float one."""
    import numpy as np
    import torch

    hidden, weight, bias = ref
    kl, same, at = [], [], 0
    with torch.no_grad():
        for s in range(0, ids.numel() - 1, window):
            chunk = ids[s:s + window][None]
            if chunk.shape[1] < 2:
                break
            lq = torch.log_softmax(model(chunk).logits[0, :-1].float(), -1)
            n = lq.shape[0]
            lp = torch.log_softmax(torch.nn.functional.linear(hidden[at:at + n], weight, bias), -1)
            at += n
            kl.append((lp.exp() * (lp.double() - lq.double())).sum(-1))
            same.append(lp.argmax(-1) == lq.argmax(-1))
    kl = torch.cat(kl).numpy()
    means = np.array([b.mean() for b in np.array_split(kl, 32)])
    t975 = {31: 2.0395134}.get(len(means) - 1, 1.96)
    return {"kld": float(kl.mean()), "kld_half95": float(t975 * means.std(ddof=1) / np.sqrt(len(means))),
            "kld_p99": float(np.percentile(kl, 99)), "kld_max": float(kl.max()),
            "same_top": float(torch.cat(same).double().mean())}


class Opts:
    """What the driver asks of every tool besides the scheme: ``layers`` (quantize decoder layers
    0..layers-1 only; None: all), ``iters`` (tuning steps of the tools that tune), ``calib_ids``
    (the calibration token windows [n, seq_len], or None) and ``recipe`` (filled in by the tool:
    the parameters it ran with, for the result JSON)."""

    def __init__(self, layers=None, iters=200, calib_ids=None):
        self.layers, self.iters, self.calib_ids = layers, iters, calib_ids
        self.recipe = {}


def decoder_layers(model):
    """(name, ModuleList) of the repeated decoder blocks: the ModuleList holding the most Linears."""
    import torch

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod):
            n = sum(isinstance(m, torch.nn.Linear) for m in mod.modules())
            if n and (best is None or n > best[0]):
                best = (n, name, mod)
    if best is None:
        raise ValueError("no decoder layers (a ModuleList of blocks with Linears) found")
    return best[1], best[2]


def skipped_layers(model, opts) -> list[str]:
    """Names of the decoder layers that stay float under ``opts.layers`` (none when it is None)."""
    prefix, layers = decoder_layers(model)
    if opts.layers is None:
        return []
    if not 1 <= opts.layers <= len(layers):
        raise ValueError(f"--layers {opts.layers}: the model has {len(layers)} decoder layers")
    return [f"{prefix}.{i}" for i in range(opts.layers, len(layers))]


def skipped_linears(model, opts) -> list[str]:
    """Full names of the Linears inside the decoder layers that stay float."""
    import torch

    out = []
    for layer in skipped_layers(model, opts):
        out += [f"{layer}.{n}" for n, m in model.get_submodule(layer).named_modules()
                if isinstance(m, torch.nn.Linear)]
    return out


def linear_kinds(model) -> dict[str, int]:
    """How many of the decoder layers' projections (names ending in ``_proj``) are of each module
    type after quantization: a check that a tool replaced (or wrapped) what it says it did."""
    from collections import Counter

    return dict(Counter(type(m).__name__ for n, m in model.named_modules() if n.rsplit(".", 1)[-1].endswith("_proj")))


def calib_windows(opts):
    """The calibration token windows [n, seq_len] from the driver (--calib-ids)."""
    from safetensors.torch import load_file

    if opts.calib_ids is None:
        raise ValueError("this tool calibrates on the driver's token windows: pass --calib-ids")
    return load_file(opts.calib_ids)["ids"]


# ----------------------------------------------------------------------------- tools
def q_float(model, tok, scheme, calib, opts):
    """No quantization: the float reference row (``run_peers.py --no-lowbit``)."""
    import torch

    return model, torch.__version__


def q_lowbit(model, tok, scheme, calib, opts, **options):
    import lowbit

    from lowbit.report.compare import set_backends

    s = lowbit.get_scheme(scheme)
    ignore = skipped_linears(model, opts)
    if s.needs_calibration:
        lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256, ignore=ignore,
                        **options)
    else:
        lowbit.quantize(model, s, ignore=ignore)
    set_backends(model, "auto")
    return model, lowbit.__version__


def q_lowbit_float(model, tok, scheme, calib, opts):
    """lowbit's defaults (GPTQ where that is the default) calibrated on float layer inputs."""
    return q_lowbit(model, tok, scheme, calib, opts, layer_inputs="float")


def q_lowbit_best(model, tok, scheme, calib, opts, **options):
    """lowbit's "best" calibration preset (GPTQ, quantized layer inputs, block-output
    reconstruction: lowbit.calibration.CALIBRATION_PRESETS) on 16 x 256 tokens of the same file;
    lowbit cuts the same evenly spaced windows the driver hands the tuned peers (--calib-ids)."""
    import lowbit

    from lowbit.report.compare import set_backends

    lowbit.quantize(model, lowbit.get_scheme(scheme), calibration=calib, tokenizer=tok, preset="best",
                    num_samples=16, seq_len=256, ignore=skipped_linears(model, opts), **options)
    opts.recipe = {"preset": "best", "num_samples": 16, "seq_len": 256, **options}
    set_backends(model, "auto")
    return model, lowbit.__version__


def q_lowbit_best_iters(model, tok, scheme, calib, opts):
    """The "best" preset with ``--iters`` reconstruction steps per layer instead of its own."""
    return q_lowbit_best(model, tok, scheme, calib, opts, reconstruct_iters=opts.iters)


def q_lowbit_gptq(model, tok, scheme, calib, opts):
    """lowbit with GPTQ weight rounding (calibrated on the same text as the peers, 16 x 256)."""
    import lowbit

    from lowbit.report.compare import set_backends
    from lowbit.algorithms.smoothquant.defaults import default_alpha

    s = lowbit.get_scheme(scheme)
    lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256,
                    weight_rounding="gptq", smoothquant=default_alpha(s), ignore=skipped_linears(model, opts))
    set_backends(model, "auto")
    return model, lowbit.__version__


def q_lowbit_gptq_fast(model, tok, scheme, calib, opts):
    """lowbit's "gptq-fast" calibration preset (GPTQ on 4 x 128 tokens, float layer inputs:
    lowbit.calibration.CALIBRATION_PRESETS), on the same text as the peers."""
    import lowbit

    from lowbit.report.compare import set_backends

    lowbit.quantize(model, lowbit.get_scheme(scheme), calibration=calib, tokenizer=tok, preset="gptq-fast",
                    ignore=skipped_linears(model, opts))
    set_backends(model, "auto")
    return model, lowbit.__version__


def q_lowbit_rtn(model, tok, scheme, calib, opts, layer_inputs="quantized"):
    """lowbit with round-to-nearest weights (calibrated on the same text when the scheme needs it),
    layer by layer on the quantized layers' outputs (lowbit-rtn-float: on float activations,
    lowbit's default with RTN weights)."""
    import lowbit

    from lowbit.report.compare import set_backends
    from lowbit.algorithms.smoothquant.defaults import default_alpha

    s = lowbit.get_scheme(scheme)
    ignore = skipped_linears(model, opts)
    if s.needs_calibration:
        lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256,
                        weight_rounding="rtn", smoothquant=default_alpha(s), layer_inputs=layer_inputs,
                        ignore=ignore)
    else:
        lowbit.quantize(model, s, ignore=ignore)
    set_backends(model, "auto")
    return model, lowbit.__version__


def q_lowbit_rtn_float(model, tok, scheme, calib, opts):
    """lowbit RTN calibrated on the float model's activations (layer_inputs="float": one float
    pass per layer, as llm-compressor's one-shot calibration observes)."""
    return q_lowbit_rtn(model, tok, scheme, calib, opts, layer_inputs="float")


AUTOROUND_SCHEMES = {"w4a16": "W4A16", "w8a16": "W8A16", "nvfp4": "NVFP4", "mxfp4": "MXFP4",
                     "w8a8-fp8": "FP8_STATIC", "nvfp4-e5m3": "NVFP4_E5M3", "w8a8-int8-dynamic": "INT8"}


def _autoround_blocks(model, opts):
    """auto-round's block selection for ``opts.layers``: None (every block) or the names of
    decoder layers 0..N-1 as its list of block lists (a string would be matched by re.search,
    so "model.layers.1" would select 10-19 too)."""
    if opts.layers is None:
        return None
    prefix, _ = decoder_layers(model)
    return [[f"{prefix}.{i}" for i in range(opts.layers)]]


def q_autoround(model, tok, scheme, calib, opts):
    import auto_round
    from auto_round import AutoRound

    if scheme not in AUTOROUND_SCHEMES:
        raise ValueError(f"no auto-round preset mapped for {scheme}")
    # iters=0 alone selects auto-round's *optimized* RTN (a calibrated scale search, minutes per
    # layer here); disable_opt_rtn=True is plain round-to-nearest, like lowbit's RTN
    ar = AutoRound(model, tok, scheme=AUTOROUND_SCHEMES[scheme], iters=0, disable_opt_rtn=True, nsamples=16,
                   seqlen=256, dataset=calib_texts(calib), device_map="cpu",
                   to_quant_block_names=_autoround_blocks(model, opts))
    ar.quantize()
    opts.recipe = {"algorithm": "RTN", "iters": 0, "disable_opt_rtn": True}
    return ar.model, auto_round.__version__


def q_autoround_tuned(model, tok, scheme, calib, opts):
    """auto-round's own recipe: SignRound tuning of each block's rounding and min/max toward the
    float block's outputs (``iters`` sign-gradient steps per block, its default lr 1/iters, batch
    8 of the 16 calibration windows per step, quantized inputs from the previous blocks). With
    iters > 0 auto-round builds a SignRoundConfig: ``disable_opt_rtn`` is an RTN option it would
    ignore, so it is not passed. Calibration: the driver's 16 x 256 token windows, given as
    [1, 256] tensors (a list of strings would be cut per string, dropping those under 256
    tokens: 5 of the 64 paragraphs the RTN rows hand it survive)."""
    import auto_round
    from auto_round import AutoRound

    if scheme not in AUTOROUND_SCHEMES:
        raise ValueError(f"no auto-round preset mapped for {scheme}")
    if opts.iters < 1:
        raise ValueError("auto-round-tuned needs --iters >= 1 (iters 0 is the auto-round RTN tool)")
    windows = calib_windows(opts)
    ar = AutoRound(model, tok, scheme=AUTOROUND_SCHEMES[scheme], iters=opts.iters, nsamples=windows.shape[0],
                   seqlen=windows.shape[1], dataset=[w[None] for w in windows], device_map="cpu",
                   to_quant_block_names=_autoround_blocks(model, opts))
    ar.quantize()
    cfg = getattr(ar, "quantize_config", None)  # the SignRoundConfig it tuned with
    opts.recipe = {"algorithm": "SignRound", "iters": opts.iters, "nsamples": int(windows.shape[0]),
                   "seqlen": int(windows.shape[1]), "batch_size": 8,
                   "config": type(cfg).__name__, "lr": getattr(cfg, "lr", None),
                   "minmax_lr": getattr(cfg, "minmax_lr", None)}
    return ar.model, auto_round.__version__


LLMC_SCHEMES = {"w4a16": "W4A16", "w8a8-int8-dynamic": "W8A8", "w8a8-fp8-dynamic": "FP8_DYNAMIC",
                "nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16", "w8a16": "W8A16"}


def _llmc_dataset(rows):
    from datasets import Dataset

    return Dataset.from_list([{"input_ids": list(r), "attention_mask": [1] * len(r)} for r in rows])


def q_llmcompressor(model, tok, scheme, calib, opts):
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if scheme not in LLMC_SCHEMES:
        raise ValueError(f"no llm-compressor preset mapped for {scheme}")
    # it refuses hidden 576 with group 128 (576 % 128 != 0) unless told the runtime copes; lowbit
    # quantizes the ragged last group, so let llm-compressor do the same
    recipe = QuantizationModifier(targets="Linear", scheme=LLMC_SCHEMES[scheme],
                                  ignore=["lm_head"] + skipped_linears(model, opts), bypass_divisibility_checks=True)
    kwargs = {}
    if scheme in ("nvfp4",):  # static input global scale: needs calibration data
        enc = [tok(t, truncation=True, max_length=256) for t in calib_texts(calib)[:16]]
        kwargs = dict(dataset=_llmc_dataset([e["input_ids"] for e in enc]),
                      num_calibration_samples=16, max_seq_length=256)
    oneshot(model=model, recipe=recipe, **kwargs)
    opts.recipe = {"algorithm": "QuantizationModifier (RTN)"}
    return model, llmcompressor.__version__


SMOOTHQUANT_STRENGTH = 0.8  # llm-compressor's W8A8 INT8 examples (its SmoothQuantModifier default is 0.5)


def _llmc_int8_static_groups() -> dict:
    """lowbit's w8a8-int8 in llm-compressor's terms: INT8 per-channel symmetric weights, one static
    symmetric INT8 scale per layer input (compressed-tensors has no preset name for it)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return {"group_0": QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True, dynamic=False),
        input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False))}


def q_llmcompressor_gptq(model, tok, scheme, calib, opts, smooth_down=False):
    """llm-compressor's GPTQ recipe: GPTQModifier (its defaults: block 128, dampening 0.01, static
    act order) on the driver's 16 x 256 token windows; for W8A8 INT8 (dynamic, and static with a
    per-tensor input scale from its observer) SmoothQuantModifier(0.8) first, as its examples do."""
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    if scheme not in LLMC_SCHEMES and scheme != "w8a8-int8":
        raise ValueError(f"no llm-compressor preset mapped for {scheme}")
    skip = skipped_linears(model, opts)
    how = {"config_groups": _llmc_int8_static_groups()} if scheme == "w8a8-int8" else \
        {"targets": "Linear", "scheme": LLMC_SCHEMES[scheme]}
    recipe = [GPTQModifier(**how, ignore=["lm_head"] + skip, bypass_divisibility_checks=True)]
    opts.recipe = {"algorithm": "GPTQModifier"}
    if scheme in ("w8a8-int8-dynamic", "w8a8-int8"):
        from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

        # ignore names the layers whose outputs get scaled (the norms; up_proj for down_proj)
        keep_float = [f"{layer}.{n}" for layer in skipped_layers(model, opts)
                      for n, _ in model.get_submodule(layer).named_modules() if n]
        maps = {}
        if scheme == "w8a8-int8" and smooth_down:
            # its default Llama mappings (q/k/v <- input norm, gate/up <- post-attention norm) plus
            # down_proj <- up_proj, as lowbit smooths by default: the static down_proj input holds
            # SmolLM2's largest outliers
            maps = {"mappings": [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"],
                                 [["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"],
                                 [["re:.*down_proj"], "re:.*up_proj"]]}
        recipe.insert(0, SmoothQuantModifier(smoothing_strength=SMOOTHQUANT_STRENGTH, ignore=keep_float or None,
                                             **maps))
        opts.recipe = {"algorithm": f"SmoothQuantModifier({SMOOTHQUANT_STRENGTH}"
                                    f"{', + down_proj <- up_proj' if maps else ''}) + GPTQModifier"}
    windows = calib_windows(opts)
    oneshot(model=model, recipe=recipe, dataset=_llmc_dataset(windows.tolist()),
            num_calibration_samples=int(windows.shape[0]), max_seq_length=int(windows.shape[1]))
    opts.recipe.update(num_calibration_samples=int(windows.shape[0]), max_seq_length=int(windows.shape[1]))
    return model, llmcompressor.__version__


def q_llmcompressor_gptq_down(model, tok, scheme, calib, opts):
    """llmcompressor-gptq with down_proj <- up_proj added to its SmoothQuant mappings (w8a8-int8)."""
    if scheme != "w8a8-int8":
        raise ValueError("llmcompressor-gptq-down is the static w8a8-int8 recipe")
    return q_llmcompressor_gptq(model, tok, scheme, calib, opts, smooth_down=True)


def q_torchao(model, tok, scheme, calib, opts):
    import torch
    import torchao
    from torchao.quantization import quantize_

    if scheme == "w4a16":
        from torchao.quantization import IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerGroup

        cfg = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(128))
    elif scheme == "w8a16":
        from torchao.quantization import Int8WeightOnlyConfig

        cfg = Int8WeightOnlyConfig()
    elif scheme == "w8a8-int8-dynamic":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        cfg = Int8DynamicActivationInt8WeightConfig()
    else:
        raise ValueError(f"no torchao config mapped for {scheme}")
    lm_head = model.get_output_embeddings()
    skip = set(skipped_linears(model, opts))
    quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not lm_head
              and fqn not in skip)
    return model, torchao.__version__


TOOLS = {"float": q_float, "lowbit": q_lowbit, "lowbit-float": q_lowbit_float, "lowbit-gptq": q_lowbit_gptq,
         "lowbit-gptq-fast": q_lowbit_gptq_fast, "lowbit-rtn": q_lowbit_rtn, "lowbit-rtn-float": q_lowbit_rtn_float,
         "lowbit-best": q_lowbit_best, "lowbit-best-iters": q_lowbit_best_iters,
         "auto-round": q_autoround, "auto-round-tuned": q_autoround_tuned,
         "llmcompressor": q_llmcompressor, "llmcompressor-gptq": q_llmcompressor_gptq,
         "llmcompressor-gptq-down": q_llmcompressor_gptq_down, "torchao": q_torchao}
# the tools whose result depends on --iters
ITERS_TOOLS = ("auto-round-tuned", "lowbit-best-iters")


def calib_texts(path):
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if len(line.split()) > 20][:64]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True, choices=sorted(TOOLS))
    ap.add_argument("--model", required=True)
    ap.add_argument("--scheme", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--calib", required=True)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--float", action="store_true", help="also measure the float model")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--layers", type=int, default=None, help="quantize decoder layers 0..N-1 only (default: all)")
    ap.add_argument("--iters", type=int, default=200, help="tuning steps of auto-round-tuned / lowbit-best-iters")
    ap.add_argument("--calib-ids", default=None, help="calibration token windows [n, seq_len] (safetensors 'ids')")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    opts = Opts(layers=a.layers, iters=a.iters, calib_ids=a.calib_ids)
    out = {"tool": a.tool, "scheme": a.scheme, "layers": a.layers,
           "iters": a.iters if a.tool in ITERS_TOOLS else None, "threads": a.threads or None}
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if a.threads:
            torch.set_num_threads(a.threads)
            torch.set_num_interop_threads(a.threads)
        ids = load_file(a.ids)["ids"]
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        out["torch"] = torch.__version__
        if a.float:
            t0 = time.perf_counter()
            out["float_ppl"], out["tokens"] = perplexity(model, ids, a.window)
            out["float_eval_s"] = time.perf_counter() - t0
        ref = float_reference(model, ids, a.window) if a.tool != "float" else None
        out["rss_before_mb"] = rss_mb()
        out["loadavg_start"] = os.getloadavg()[0]
        out["started_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            model, version = TOOLS[a.tool](model, tok, a.scheme, a.calib, opts)
            out["quant_s"] = time.perf_counter() - t0
            out["quant_cpu_s"] = time.process_time() - c0  # all threads; robust to a shared machine
        out["loadavg_end_quant"] = os.getloadavg()[0]
        out["torch_threads_after"] = torch.get_num_threads()
        out["recipe"] = opts.recipe
        out["proj_modules"] = linear_kinds(model)
        out["peak_rss_mb"] = mem.peak
        out["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["version"] = version
        t0 = time.perf_counter()
        out["ppl"], out["tokens"] = perplexity(model, ids, a.window)
        out["eval_s"] = time.perf_counter() - t0
        if ref is not None:
            out.update(kl_divergence(model, ids, a.window, ref))
        if a.tool == "float":
            out["float_ppl"] = out["ppl"]
        out["loadavg_end"] = os.getloadavg()[0]
        out["status"] = "ok"
    except BaseException as e:  # recorded, not raised: the driver reports every tool
        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["traceback"] = traceback.format_exc()[-3000:]
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
