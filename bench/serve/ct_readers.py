"""Who reads lowbit's compressed-tensors output right? Three readers against an exact reference.

For each scheme, the built-in SmolLM2-135M is quantized (static schemes calibrated on the built-in
text with lowbit's defaults, ``--calib-samples`` x ``--calib-seq-len``) and saved as
compressed-tensors; then the same folder is read by

- ``lowbit-auto``: ``lowbit.load(folder)`` (the default backend: cpu-int8 / weight-cache),
- ``lowbit-ref``: ``lowbit.load(folder, backend="reference")``,
- ``stock``: transformers + compressed-tensors (``AutoModelForCausalLM.from_pretrained``, float32),
- ``f64``: what the config and tensors mean, computed in float64: every weight ``code * scale``
  exactly, every input ``clamp(round(x / s)) * s`` with ``s`` from the stored static scale or from
  the row's amax (``amax / qmax``) for dynamic inputs, the whole model (norms, attention,
  softmax) in float64. For E4M3 inputs ``x / s`` is rounded to float32 before the E4M3 rounding
  (a double rounding only when the float32 value lands exactly on an E4M3 tie).

Per reader: perplexity on ``--tokens`` tokens of the built-in evaluation text (windows of 512,
the first token of each window not scored), the relative L2 distance of its logits to ``f64``
and the top-1 agreement with ``f64``. Then the spread: lowbit-auto's perplexity when the input
embeddings get a relative perturbation of ``--eps`` (``--seeds`` seeds), which tells noise (a
chaotic model at float32 precision) from bias (a reader systematically closer to float).

    .venv/bin/python bench/serve/ct_readers.py [--schemes w8a8-int8,w8a8-int8-dynamic,w8a8-fp8-dynamic]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import lowbit
from lowbit.eval.perplexity import tokenize_with_bytes
from lowbit.eval.text import read_paragraphs
from lowbit.models import load_model
from lowbit.modules import QuantLinear
from lowbit.numerics import FormatName, get_format
from lowbit.schemes import Dynamic, Granularity

WINDOW = 512


class F64Linear(nn.Module):
    """What a compressed-tensors linear means, in float64 (see the module docstring)."""

    def __init__(self, q: QuantLinear) -> None:
        super().__init__()
        w = q.weight_qtensor()
        fmt = get_format(w.spec.format)
        vals = fmt.decode(w.codes).to(torch.float64)
        scale = w.scale.to(torch.float64).reshape(vals.shape[0], -1)
        if scale.shape[1] == 1:
            self.weight = vals * scale
        else:  # group scales
            g = vals.shape[1] // scale.shape[1]
            self.weight = (vals.reshape(vals.shape[0], -1, g) * scale[..., None]).reshape(vals.shape)
        if w.global_scale is not None:
            self.weight = self.weight / w.global_scale.to(torch.float64)
        self.bias = None if q.bias is None else q.bias.to(torch.float64)
        self.act = q.scheme.input_activations
        self.input_scale = None if q.input_scale is None else q.input_scale.to(torch.float64)

    def _qdq(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act
        fmt = get_format(a.format)
        if a.dynamic is Dynamic.STATIC:
            s = self.input_scale
        elif a.granularity is Granularity.TOKEN:
            s = x.abs().amax(dim=-1, keepdim=True) / float(fmt.max_finite)
            s = torch.where(s == 0, torch.ones_like(s), s)
        else:
            raise NotImplementedError(f"f64 reference: {a.describe()}")
        y = x / s
        if a.format is FormatName.INT8:
            y = torch.round(y).clamp(-128, 127)
        else:
            y = fmt.qdq(y.to(torch.float32)).to(torch.float64)
        return y * s

    def forward(self, x):
        x = x.to(torch.float64)
        if self.act is not None:
            x = self._qdq(x)
        return F.linear(x, self.weight, self.bias)


def f64_model(folder: Path):
    model = lowbit.load(folder, backend="reference")
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantLinear):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, F64Linear(m))
    return model.to(torch.float64).eval()


def stock_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def window_logits(model, ids: torch.Tensor, embeds_noise: tuple[float, int] | None = None) -> list[torch.Tensor]:
    out = []
    for i in range(0, ids.numel() - 1, WINDOW):
        w = ids[i:i + WINDOW][None]
        if embeds_noise is None:
            lg = model(w).logits
        else:
            eps, seed = embeds_noise
            e = model.get_input_embeddings()(w)
            g = torch.Generator().manual_seed(seed)
            e = e * (1 + eps * torch.randn(e.shape, generator=g, dtype=e.dtype))
            lg = model(inputs_embeds=e).logits
        out.append(lg[0].to(torch.float64))
    return out


def ppl(logits: list[torch.Tensor], ids: torch.Tensor) -> float:
    nll, n = 0.0, 0
    for j, lg in enumerate(logits):
        w = ids[j * WINDOW:j * WINDOW + lg.shape[0]]
        lp = torch.log_softmax(lg[:-1], dim=-1)
        nll -= float(lp.gather(1, w[1:, None]).sum())
        n += w.numel() - 1
    return math.exp(nll / n)


def distance(a: list[torch.Tensor], ref: list[torch.Tensor]) -> tuple[float, float]:
    num = sum(float((x - r).pow(2).sum()) for x, r in zip(a, ref))
    den = sum(float(r.pow(2).sum()) for r in ref)
    agree = sum(int((x.argmax(-1) == r.argmax(-1)).sum()) for x, r in zip(a, ref))
    total = sum(r.shape[0] for r in ref)
    return math.sqrt(num / den), agree / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default="w8a8-int8,w8a8-int8-dynamic,w8a8-fp8-dynamic")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--eps", type=float, default=1e-7)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--spread-readers", default="f64,lowbit-auto,stock,lowbit-ref",
                    help="readers whose perturbation spread is measured")
    ap.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    args = ap.parse_args()
    base, tok = load_model(None)
    ids, _ = tokenize_with_bytes(tok, "\n".join(read_paragraphs(None)))
    ids = ids[: args.tokens + 1]
    root = Path(args.out or tempfile.mkdtemp(prefix="lowbit-ct-readers-"))
    t0 = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.2f}; {ids.numel() - 1} tokens, windows of {WINDOW}")
    fl = window_logits(base, ids)
    print(f"float ppl {ppl(fl, ids):.4f}")
    print(f"| scheme | reader | ppl | ppl, embeddings x (1 + {args.eps:g} N(0,1)), {args.seeds} seeds: mean +- sd (range) "
          f"| rel. L2 to f64 | top-1 = f64 |")
    print("|---|---|---|---|---|---|")
    for name in args.schemes.split(","):
        sch = lowbit.get_scheme(name)
        kw = {}
        if sch.needs_calibration:
            kw = dict(calibration="builtin", tokenizer=tok, num_samples=args.calib_samples, seq_len=args.calib_seq_len)
        q = lowbit.quantize(copy.deepcopy(base), sch, **kw)
        folder = root / name
        lowbit.save(q, folder, format="compressed-tensors", tokenizer=tok, overwrite=True)
        del q
        readers = {"f64": f64_model, "lowbit-auto": lambda f: lowbit.load(f), "stock": stock_model,
                   "lowbit-ref": lambda f: lowbit.load(f, backend="reference")}
        logits, spreads = {}, {}
        for rname, build in readers.items():
            m = build(folder)
            logits[rname] = window_logits(m, ids)
            if rname in args.spread_readers.split(","):
                spreads[rname] = [ppl(window_logits(m, ids, (args.eps, s)), ids) for s in range(args.seeds)]
            del m
        for rname, lg in logits.items():
            d, agree = distance(lg, logits["f64"])
            sp = spreads.get(rname)
            spread = "" if sp is None else (f"{statistics.mean(sp):.4f} +- {statistics.stdev(sp):.4f} "
                                            f"({min(sp):.4f}-{max(sp):.4f})")
            print(f"| {name} | {rname} | {ppl(lg, ids):.4f} | {spread} | {d:.2e} | {100 * agree:.1f}% |", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
