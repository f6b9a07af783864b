"""Compare lowbit's model-free output with auto-round's, layer by layer (same source checkpoint).

    .venv/bin/python bench/modelfree/compare_autoround.py --src SRC --lowbit OUT_LOWBIT --autoround OUT_AR --scheme w4a16

Both outputs as written by bench/modelfree/bench_modelfree.py --keep-outputs (lowbit format "lowbit",
auto-round format "auto_round"). auto-round's tensors are decoded here from its documented layouts
(not with lowbit's readers), lowbit's with lowbit's own reader. Per layer it prints: equal element
values (codes decoded: -0 == +0) and equal bit codes, equal scales, the distribution of the scale
ratio auto-round / lowbit, the largest difference of the dequantized weights and the relative
squared error of each tool against the source weight.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.formats import Format, get_layout
from lowbit.numerics import FormatName, get_format
from lowbit.quant.qdq import dequantize
from lowbit.schemes import get_scheme

DEFAULT_LAYERS = "model.layers.0.self_attn.q_proj,model.layers.1.mlp.down_proj"


def read_tensors(folder: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor of ``folder``'s shards whose name starts with ``prefix + '.'``."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if k.startswith(prefix + ".")})
    if not out:
        raise KeyError(f"no tensor {prefix}.* in {folder}")
    return out


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> codes [out, in], element 2i in the low nibble (compressed-tensors order)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def unpack_gptq(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """auto_gptq qweight int32 [in / (32/bits), out] -> unsigned codes [out, in] (low bits first)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    q = (qweight.to(torch.int64)[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return q.reshape(-1, qweight.shape[1]).t().contiguous()


# auto-round's group sizes (its W8A16 is group 128 where lowbit's w8a16 is per channel)
AR_GROUP = {"w4a16": 128, "w8a16": 128, "mxfp4": 32, "mxfp8": 32, "nvfp4-e5m3": 16}


def expand(scale: torch.Tensor, in_f: int, group: int) -> torch.Tensor:
    """Group scales [out, ceil(in / group)] -> [out, in] (the last group may be partial)."""
    return scale.repeat_interleave(group, dim=1)[:, :in_f]


def autoround_layer(t: dict[str, torch.Tensor], prefix: str, scheme: str, in_f: int) -> dict[str, torch.Tensor]:
    """auto-round's decoded layer: element values (unscaled), codes, scales [out, groups], weight.
    ``in_f``: the source's input features (auto_gptq pads them to a multiple of the group size)."""
    if scheme in ("w4a16", "w8a16"):
        bits = 4 if scheme == "w4a16" else 8
        u = unpack_gptq(t[f"{prefix}.qweight"], bits)[:, :in_f]
        values = (u - (1 << (bits - 1))).to(torch.float32)  # symmetric: codes offset by 2^(bits-1)
        codes = values.to(torch.int64) & ((1 << bits) - 1)  # two's complement, as lowbit stores them
        scale = t[f"{prefix}.scales"].t().to(torch.float32)
    else:
        elem = {"mxfp4": FormatName.E2M1, "nvfp4-e5m3": FormatName.E2M1, "mxfp8": FormatName.E4M3}[scheme]
        sfmt = {"nvfp4-e5m3": FormatName.UE5M3}.get(scheme, FormatName.E8M0)
        codes = unpack_nibbles(t[f"{prefix}.weight_packed"]) if elem is FormatName.E2M1 \
            else t[f"{prefix}.weight"].view(torch.uint8)
        values = get_format(elem).decode(codes)
        scale = get_format(sfmt).decode(t[f"{prefix}.weight_scale"])
    return dict(values=values, codes=codes.to(torch.int64), scale=scale,
                weight=values * expand(scale, values.shape[1], AR_GROUP[scheme]))


def lowbit_layer(t: dict[str, torch.Tensor], prefix: str, scheme: str) -> dict[str, torch.Tensor]:
    qt = get_layout(Format.LOWBIT).read_linear(prefix, t, get_scheme(scheme)).qweight
    return dict(values=qt.values(), codes=qt.codes.to(torch.int64), scale=qt.scale.to(torch.float32),
                weight=dequantize(qt))


def rel_err(w: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((w - ref) ** 2).sum() / (ref ** 2).sum())


def compare_layer(src: Path, lb: Path, ar: Path, prefix: str, scheme: str) -> dict:
    ref = read_tensors(src, prefix)[f"{prefix}.weight"].to(torch.float32)
    a = lowbit_layer(read_tensors(lb, prefix), prefix, scheme)
    b = autoround_layer(read_tensors(ar, prefix), prefix, scheme, ref.shape[1])
    res = dict(layer=prefix, scheme=scheme, shape=list(ref.shape),
               rel_err_lowbit=rel_err(a["weight"], ref), rel_err_autoround=rel_err(b["weight"], ref))
    dw = (a["weight"] - b["weight"]).abs()
    res.update(weights_differing=float((dw > 0).float().mean()), max_abs_diff=float(dw.max()),
               max_abs_weight=float(ref.abs().max()))
    if a["scale"].shape == b["scale"].shape:  # same granularity: codes and scales comparable
        ratio = b["scale"] / a["scale"]
        vals, counts = torch.unique(ratio[a["scale"] != 0], return_counts=True)
        top = sorted(zip(counts.tolist(), vals.tolist()), reverse=True)[:4]
        res.update(equal_values=float((a["values"] == b["values"]).float().mean()),
                   equal_codes=float((a["codes"] == b["codes"]).float().mean()),
                   equal_scales=float((a["scale"] == b["scale"]).float().mean()),
                   scale_ratio_top={f"{v:.6g}": c / ratio.numel() for c, v in top},
                   weights_differing_in_equal_scale_groups=float(
                       ((dw > 0) & expand(a["scale"] == b["scale"], ref.shape[1], AR_GROUP[scheme])).float().mean()))
    else:
        res.update(scale_shapes=[list(a["scale"].shape), list(b["scale"].shape)])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True, help="the source checkpoint folder")
    ap.add_argument("--lowbit", required=True, help="lowbit's output folder (format lowbit)")
    ap.add_argument("--autoround", required=True, help="auto-round's output folder (format auto_round)")
    ap.add_argument("--scheme", required=True, choices=["w4a16", "w8a16", "mxfp4", "mxfp8", "nvfp4-e5m3"])
    ap.add_argument("--layers", default=DEFAULT_LAYERS, help="comma-separated Linear names")
    args = ap.parse_args()
    for prefix in args.layers.split(","):
        print(json.dumps(compare_layer(Path(args.src), Path(args.lowbit), Path(args.autoround), prefix,
                                       args.scheme)), flush=True)


if __name__ == "__main__":
    main()
