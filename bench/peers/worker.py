"""One tool, one scheme, one model: quantize in memory, time it, measure peak RSS and perplexity.

Runs inside each tool's own virtual environment (it imports only torch, transformers,
safetensors and the tool), so it must not import lowbit unless the tool is lowbit. The
evaluation token ids come from the driver (run_peers.py) in a safetensors file, so every tool
scores exactly the same windows with the same code (full logits: fine for a 49k vocabulary).

    python worker.py --tool TOOL --model DIR --scheme SCHEME --ids ids.safetensors --window 512 --out r.json
"""

from __future__ import annotations

import argparse
import json
import math
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


# ----------------------------------------------------------------------------- tools
def q_lowbit(model, tok, scheme, calib, **options):
    import lowbit

    from lowbit.report.compare import set_backends

    s = lowbit.get_scheme(scheme)
    if s.needs_calibration:
        lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256, **options)
    else:
        lowbit.quantize(model, s)
    set_backends(model, "fast")
    return model, lowbit.__version__


def q_lowbit_float(model, tok, scheme, calib):
    """lowbit's defaults (GPTQ where that is the default) calibrated on float layer inputs."""
    return q_lowbit(model, tok, scheme, calib, layer_inputs="float")


def q_lowbit_gptq(model, tok, scheme, calib):
    """lowbit with GPTQ weight rounding (calibrated on the same text as the peers, 16 x 256)."""
    import lowbit

    from lowbit.report.compare import set_backends
    from lowbit.algorithms.smoothquant.defaults import default_alpha

    s = lowbit.get_scheme(scheme)
    lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256,
                    weight_rounding="gptq", smoothquant=default_alpha(s))
    set_backends(model, "fast")
    return model, lowbit.__version__


def q_lowbit_gptq_fast(model, tok, scheme, calib):
    """lowbit's "gptq-fast" calibration preset (GPTQ on 4 x 128 tokens, float layer inputs:
    lowbit.calibration.CALIBRATION_PRESETS), on the same text as the peers."""
    import lowbit

    from lowbit.report.compare import set_backends

    lowbit.quantize(model, lowbit.get_scheme(scheme), calibration=calib, tokenizer=tok, preset="gptq-fast")
    set_backends(model, "fast")
    return model, lowbit.__version__


def q_lowbit_rtn(model, tok, scheme, calib, layer_inputs="quantized"):
    """lowbit with round-to-nearest weights (calibrated on the same text when the scheme needs it),
    layer by layer on the quantized layers' outputs (lowbit-rtn-float: on float activations,
    lowbit's default with RTN weights)."""
    import lowbit

    from lowbit.report.compare import set_backends
    from lowbit.algorithms.smoothquant.defaults import default_alpha

    s = lowbit.get_scheme(scheme)
    if s.needs_calibration:
        lowbit.quantize(model, s, calibration=calib, tokenizer=tok, num_samples=16, seq_len=256,
                        weight_rounding="rtn", smoothquant=default_alpha(s), layer_inputs=layer_inputs)
    else:
        lowbit.quantize(model, s)
    set_backends(model, "fast")
    return model, lowbit.__version__


def q_lowbit_rtn_float(model, tok, scheme, calib):
    """lowbit RTN calibrated on the float model's activations (layer_inputs="float": one float
    pass per layer, as llm-compressor's one-shot calibration observes)."""
    return q_lowbit_rtn(model, tok, scheme, calib, layer_inputs="float")


AUTOROUND_SCHEMES = {"w4a16": "W4A16", "w8a16": "W8A16", "nvfp4": "NVFP4", "mxfp4": "MXFP4",
                     "w8a8-fp8": "FP8_STATIC", "nvfp4-e5m3": "NVFP4_E5M3", "w8a8-int8-dynamic": "INT8"}


def q_autoround(model, tok, scheme, calib):
    import auto_round
    from auto_round import AutoRound

    if scheme not in AUTOROUND_SCHEMES:
        raise ValueError(f"no auto-round preset mapped for {scheme}")
    # iters=0 alone selects auto-round's *optimized* RTN (a calibrated scale search, minutes per
    # layer here); disable_opt_rtn=True is plain round-to-nearest, like lowbit's RTN
    ar = AutoRound(model, tok, scheme=AUTOROUND_SCHEMES[scheme], iters=0, disable_opt_rtn=True, nsamples=16,
                   seqlen=256, dataset=calib_texts(calib), device_map="cpu")
    ar.quantize()
    return ar.model, auto_round.__version__


LLMC_SCHEMES = {"w4a16": "W4A16", "w8a8-int8-dynamic": "W8A8", "w8a8-fp8-dynamic": "FP8_DYNAMIC",
                "nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16", "w8a16": "W8A16"}


def q_llmcompressor(model, tok, scheme, calib):
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if scheme not in LLMC_SCHEMES:
        raise ValueError(f"no llm-compressor preset mapped for {scheme}")
    # it refuses hidden 576 with group 128 (576 % 128 != 0) unless told the runtime copes; lowbit
    # quantizes the ragged last group, so let llm-compressor do the same
    recipe = QuantizationModifier(targets="Linear", scheme=LLMC_SCHEMES[scheme], ignore=["lm_head"],
                                  bypass_divisibility_checks=True)
    kwargs = {}
    if scheme in ("nvfp4",):  # static input global scale: needs calibration data
        from datasets import Dataset

        enc = [tok(t, truncation=True, max_length=256) for t in calib_texts(calib)[:16]]
        kwargs = dict(dataset=Dataset.from_list([{"input_ids": e["input_ids"]} for e in enc]),
                      num_calibration_samples=16, max_seq_length=256)
    oneshot(model=model, recipe=recipe, **kwargs)
    return model, llmcompressor.__version__


def q_torchao(model, tok, scheme, calib):
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
    quantize_(model, cfg, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and m is not lm_head)
    return model, torchao.__version__


TOOLS = {"lowbit": q_lowbit, "lowbit-float": q_lowbit_float, "lowbit-gptq": q_lowbit_gptq, "lowbit-gptq-fast": q_lowbit_gptq_fast, "lowbit-rtn": q_lowbit_rtn, "lowbit-rtn-float": q_lowbit_rtn_float, "auto-round": q_autoround, "llmcompressor": q_llmcompressor, "torchao": q_torchao}


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
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"tool": a.tool, "scheme": a.scheme}
    try:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if a.threads:
            torch.set_num_threads(a.threads)
        ids = load_file(a.ids)["ids"]
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
        out["torch"] = torch.__version__
        if a.float:
            t0 = time.perf_counter()
            out["float_ppl"], out["tokens"] = perplexity(model, ids, a.window)
            out["float_eval_s"] = time.perf_counter() - t0
        out["rss_before_mb"] = rss_mb()
        with PeakRSS() as mem:
            t0, c0 = time.perf_counter(), time.process_time()
            model, version = TOOLS[a.tool](model, tok, a.scheme, a.calib)
            out["quant_s"] = time.perf_counter() - t0
            out["quant_cpu_s"] = time.process_time() - c0  # all threads; robust to a shared machine
        out["peak_rss_mb"] = mem.peak
        out["process_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["version"] = version
        t0 = time.perf_counter()
        out["ppl"], out["tokens"] = perplexity(model, ids, a.window)
        out["eval_s"] = time.perf_counter() - t0
        out["status"] = "ok"
    except BaseException as e:  # recorded, not raised: the driver reports every tool
        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {e}"[:500]
        out["traceback"] = traceback.format_exc()[-3000:]
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
