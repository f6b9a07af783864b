"""lowbit.load on auto-round's GPTQ-packed INT output (``auto_round:auto_gptq``), against lowbit's
own output of the same scheme from the same source.

    PYTHONPATH=src .venv/bin/python bench/modelfree/read_autoround_gptq.py --src SRC --autoround AR_OUT \
        [--lowbit LOWBIT_OUT | --scheme-group 128] [--tokens 128]

--lowbit: a folder lowbit wrote (e.g. model-free w4a16); without it the source is quantized here
by RTN with INT<bits> group --scheme-group, full-range observer (auto-round's W8A16 is group 128,
lowbit's w8a16 preset is per channel). Prints one JSON object: load CPU-s, the scheme read, the
fraction of equal codes and scales over all quantized layers, max |logit difference| between the
two (and each against the float source) on fixed random token ids, and the argmax agreement.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch

import lowbit
from lowbit.files.folder import read_config
from lowbit.model_quant import every_linear, quantize_rtn
from lowbit.modules import QuantLinear
from lowbit.quant import dequantize
from lowbit.schemes import WeightObserver, QuantSpec, Scheme


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def layers(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def float_model(src: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).eval()


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", type=Path, required=True)
    ap.add_argument("--autoround", type=Path, required=True)
    ap.add_argument("--lowbit", type=Path)
    ap.add_argument("--scheme-group", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    torch.manual_seed(0)
    vocab = read_config(a.src)["vocab_size"]
    ids = torch.randint(0, vocab, (2, a.tokens), generator=torch.Generator().manual_seed(0))
    c0, t0 = cpu_s(), time.perf_counter()
    ar = lowbit.load(a.autoround, backend="reference")
    res = {"autoround": str(a.autoround), "load_cpu_s": round(cpu_s() - c0, 2),
           "load_wall_s": round(time.perf_counter() - t0, 2)}
    la = layers(ar)
    scheme = next(iter(la.values())).scheme
    res.update(scheme=scheme.name, weights=scheme.weights.describe(), layers=len(la))
    if a.lowbit is not None:
        lb = lowbit.load(a.lowbit, backend="reference")
        res["lowbit"] = str(a.lowbit)
    else:
        bits = scheme.weights.bits
        own = Scheme(f"int{bits}-g{a.scheme_group}", QuantSpec(f"int{bits}", "group", a.scheme_group,
                                                               observer=WeightObserver.FULL_RANGE), None)
        lb = float_model(a.src)
        quantize_rtn(lb, every_linear(lb, own, ignore=["lm_head"]))
        lowbit.use_backend(lb, "reference")
        res["lowbit"] = f"quantize_rtn {own.weights.describe()} (in memory)"
    lb_l = layers(lb)
    assert list(lb_l) == list(la), "different quantized layers"
    n = codes = scales = scale_n = groups_opposite = differ = differ_elsewhere = 0
    for k, m in la.items():
        x, y = m.weight_qtensor(), lb_l[k].weight_qtensor()
        n += x.codes.numel()
        codes += int((x.codes == y.codes).sum())
        dw = dequantize(x) != dequantize(y)
        differ += int(dw.sum())
        if x.scale.shape == y.scale.shape:
            scale_n += x.scale.numel()
            scales += int((x.scale == y.scale).sum())
            opp = (x.scale == -y.scale) & (x.scale != 0)
            groups_opposite += int(opp.sum())
            g = x.spec.group_size or x.shape[1]
            differ_elsewhere += int((dw & ~opp.repeat_interleave(g, dim=1)[:, :x.shape[1]]).sum())
    res.update(equal_codes=codes / n, equal_scales=scales / scale_n if scale_n else None,
               scales_of_opposite_sign=groups_opposite / scale_n if scale_n else None,
               weights_differing=differ / n,
               weights_differing_outside_opposite_groups=differ_elsewhere if scale_n else None)
    la_out, lb_out = logits(ar, ids), logits(lb, ids)
    ref = logits(float_model(a.src), ids)
    d = (la_out - lb_out).abs()
    res.update(max_abs_logit_diff=float(d.max()), mean_abs_logit_diff=float(d.mean()),
               max_abs_logit=float(lb_out.abs().max()),
               argmax_agreement=float((la_out.argmax(-1) == lb_out.argmax(-1)).float().mean()),
               autoround_vs_float_mean_abs=float((la_out - ref).abs().mean()),
               lowbit_vs_float_mean_abs=float((lb_out - ref).abs().mean()),
               total_cpu_s=round(cpu_s(), 2))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
