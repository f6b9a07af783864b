"""The ``compare`` step of bench/serve/serve_model_ops.py: each op outside the linears, fed vLLM's own
captured inputs, against vLLM's captured output. Candidates per op:

  hf      transformers' bf16 module arithmetic (what lowbit's bf16 emulation ran until now);
  lowbit  ``lowbit.quant.serving_ops`` (the vLLM-CPU rules lowbit now emulates);
  others  single-rounding float32 variants, to show which rounding vLLM does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

BF = torch.bfloat16


def _equal_share(a: torch.Tensor, b: torch.Tensor) -> str:
    a, b = a.float(), b.float()
    eq = (a == b).float().mean().item() * 100
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    return f"{eq:7.3f}% bit-equal, rel {rel:.1e}"


def _hf_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(BF)


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(BF) + rot * sin.to(BF)


def compare(folder: str, cap_path: str) -> None:
    from lowbit.quant import serving_ops as so

    cap = torch.load(cap_path, weights_only=False)  # our own capture file
    ops = cap["ops"]
    cfg = json.loads((Path(folder) / "config.json").read_text())
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta")
    files = sorted(Path(folder).glob("*.safetensors"))
    weights = {}
    for f in files:
        with safe_open(f, "pt") as s:
            for k in s.keys():
                if k.endswith("layernorm.weight") or k == "model.norm.weight":
                    weights[k] = s.get_tensor(k).to(BF)
    rows: dict[str, dict[str, list]] = {}

    def add(op, cand, a, b):
        rows.setdefault(op, {}).setdefault(cand, []).append((a.float(), b.float()))

    n = len(cap["ids"])
    pos = torch.arange(n)
    cos, sin = so.rope_cos_sin(pos, hd, theta)             # float32 [n, hd]
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in ops if ".layers." in k})
    for i in layers:
        p = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            r = ops[p + norm]
            w = weights[p + norm + ".weight"]
            args = r["args"]
            if len(args) == 1:
                x = args[0]
                add("rmsnorm (no residual)", "hf", _hf_rms(x, w, eps), r["out"])
                add("rmsnorm (no residual)", "lowbit", so.rms_norm(x, w, eps), r["out"])
            else:
                x, res = args
                out, res_out = r["out"]
                s16 = (x + res)                                     # transformers: the bf16 sum
                add("add + rmsnorm: residual", "hf (bf16 add)", s16, res_out)
                add("add + rmsnorm: normed", "hf (norm of the bf16 sum)", _hf_rms(s16, w, eps), out)
                o2, r2 = so.add_rms_norm(x, res, w, eps)
                add("add + rmsnorm: residual", "lowbit", r2, res_out)
                add("add + rmsnorm: normed", "lowbit (norm of the float32 sum)", o2, out)
        r = ops.get(p + "self_attn.rotary_emb")  # one module shared by every layer: captured once
        if r is not None:
            _, q, k = r["args"]
            qo, ko = r["out"]
            qh, kh = q.view(n, heads, hd), k.view(n, kv, hd)
            c, s_ = cos[:, None, :], sin[:, None, :]
            add("rope q", "hf (3 bf16 roundings)", _hf_rope(qh, c, s_).reshape(n, -1), qo)
            add("rope k", "hf (3 bf16 roundings)", _hf_rope(kh, c, s_).reshape(n, -1), ko)
            add("rope q", "lowbit", so.rope(qh, c, s_).reshape(n, -1), qo)
            add("rope k", "lowbit", so.rope(kh, c, s_).reshape(n, -1), ko)
        r = ops[p + "self_attn.attn"]
        q, k, v = r["args"]
        qh = q.view(n, heads, hd).transpose(0, 1)[None]
        kh = k.view(n, kv, hd).transpose(0, 1)[None].repeat_interleave(heads // kv, 1)
        vh = v.view(n, kv, hd).transpose(0, 1)[None].repeat_interleave(heads // kv, 1)
        hf = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
        add("attention", "hf (torch sdpa, bf16)", hf[0].transpose(0, 1).reshape(n, -1), r["out"])
        f32 = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), is_causal=True).to(BF)
        add("attention", "float32 sdpa, one rounding", f32[0].transpose(0, 1).reshape(n, -1), r["out"])
        add("attention", "lowbit", so.attention(q.view(n, heads, hd), k.view(n, kv, hd), v.view(n, kv, hd),
                                                hd ** -0.5).reshape(n, -1), r["out"])
        r = ops[p + "mlp.act_fn"]
        x = r["args"][0]
        d = x.shape[-1] // 2
        add("silu * mul", "hf (2 bf16 roundings)", F.silu(x[..., :d]) * x[..., d:], r["out"])
        add("silu * mul", "float32, one rounding", (F.silu(x[..., :d].float()) * x[..., d:].float()).to(BF), r["out"])
        add("silu * mul", "lowbit", so.silu_and_mul(x), r["out"])
    r = ops["model.norm"]
    x, res = r["args"]
    out = r["out"][0] if isinstance(r["out"], (tuple, list)) else r["out"]
    w = weights["model.norm.weight"]
    add("final add + rmsnorm", "hf (norm of the bf16 sum)", _hf_rms(x + res, w, eps), out)
    add("final add + rmsnorm", "lowbit", so.add_rms_norm(x, res, w, eps)[0], out)
    print(f"{len(layers)} layers, {n} tokens, attention: {cap.get('attn_info')}")
    for op, cands in rows.items():
        for cand, pairs in cands.items():
            a = torch.cat([x.flatten() for x, _ in pairs])
            b = torch.cat([y.flatten() for _, y in pairs])
            print(f"{op:26s} {cand:36s} {_equal_share(a, b)}")


def chain(folder: str, cap_path: str) -> None:
    """The whole model at once (no teacher forcing): lowbit.load(FOLDER, numerics=VLLM_CPU) on the
    captured prompt, each layer's linear inputs and outputs against vLLM's, as the share of
    bit-equal values per layer, and the prompt log-probabilities against vLLM's."""
    import lowbit
    from lowbit.quant.serving import ServingNumerics

    cap = torch.load(cap_path, weights_only=False)  # our own capture file
    ops = cap["ops"]
    m = lowbit.load(folder, numerics=ServingNumerics.VLLM_CPU)
    got: dict = {}

    def hook(name):
        def f(mod, args, out):
            got.setdefault(name, (args[0].detach()[0].clone(), (out[0] if isinstance(out, tuple) else out).detach()[0]))
        return f

    for name, mod in m.named_modules():
        if name.endswith(("q_proj", "o_proj", "gate_proj", "down_proj")) and ".layers." in name:
            mod.register_forward_hook(hook(name))
    ids = torch.tensor([cap["ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=ids).logits[0].double(), -1)
    lp = lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]]
    v = torch.tensor(cap["logprobs"], dtype=torch.float64)
    print(f"prompt of {ids.shape[1]} tokens: ppl vLLM {v.mean().neg().exp().item():.4f}, lowbit's emulation "
          f"{lp.mean().neg().exp().item():.4f}, max |d log p| {(lp - v).abs().max().item():.2e}")
    print("layer  qkv in   o in  o out  gate_up in  down in  down out   (% bit-equal to vLLM)")
    pairs = (("self_attn.q_proj", 0, "self_attn.qkv_proj", "args"), ("self_attn.o_proj", 0, "self_attn.o_proj", "args"),
             ("self_attn.o_proj", 1, "self_attn.o_proj", "out"), ("mlp.gate_proj", 0, "mlp.gate_up_proj", "args"),
             ("mlp.down_proj", 0, "mlp.down_proj", "args"), ("mlp.down_proj", 1, "mlp.down_proj", "out"))
    layers = sorted({int(k.split(".layers.")[1].split(".")[0]) for k in ops if ".layers." in k})
    for i in layers:
        p = f"model.layers.{i}."
        row = []
        for ours, j, theirs, part in pairs:
            a, b = got[p + ours][j], ops[p + theirs][part][0]
            row.append((a.float() == b.float()).float().mean().item() * 100)
        print(f"{i:5d}  " + "  ".join(f"{x:7.3f}" for x in row))
