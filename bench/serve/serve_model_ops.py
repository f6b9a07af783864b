"""Op by op, outside the linears: what vLLM-CPU's bf16 model computes between the quantized
linears (RMSNorm with the residual add, RoPE, attention, SiLU·mul, the final norm), against
transformers' bf16 ops and lowbit's serving emulation of them (issue 21). Two steps, two venvs:

    .venv-vllm/bin/python bench/serve/serve_model_ops.py capture FOLDER OUT.pt [--tokens 256]
    .venv/bin/python      bench/serve/serve_model_ops.py compare FOLDER OUT.pt
    .venv/bin/python      bench/serve/serve_model_ops.py chain FOLDER OUT.pt

``capture`` serves FOLDER in bfloat16 (Llama-family models), runs one prompt of the first
``--tokens`` tokens of the packaged evaluation text and records, for every decoder layer, the
inputs and outputs of each op (cloned before the op runs: vLLM's norms and RoPE work in place).

``compare`` feeds each op vLLM's own inputs (teacher forcing: one op at a time, so errors do not
compound) and prints, per op, the share of outputs bit-equal to vLLM's for each candidate
implementation: transformers' bf16 op and lowbit's ``lowbit.quant.serving_ops`` emulation.

``chain`` runs the whole emulated model (``lowbit.load(FOLDER, numerics=VLLM_CPU)``) on the same
prompt and prints, layer by layer, the share of its linears' inputs and outputs bit-equal to
vLLM's, and the prompt log-probabilities against vLLM's.
"""

from __future__ import annotations

import sys
from pathlib import Path

OPS = ("input_layernorm", "post_attention_layernorm", "rotary_emb", "attn", "act_fn", "o_proj",
       "down_proj", "qkv_proj", "gate_up_proj")


def _clone(v):
    import torch

    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_clone(x) for x in v)
    return v


def capture(folder: str, out: str, tokens: int) -> None:
    import torch

    from serve_common import prompt_logprobs, served_prompt

    llm, ids = served_prompt(folder, tokens)
    rec: dict = {"ids": ids, "ops": {}}

    def install(model):
        n = 0
        for name, mod in model.named_modules():
            short = name.rsplit(".", 1)[-1]
            if name.endswith("model.norm") or name.endswith("embed_tokens") or (short in OPS and ".layers." in name):
                def pre(m, args, kwargs, name=name):
                    if name not in rec["ops"]:
                        rec["ops"][name] = {"args": _clone(args), "kwargs": _clone(kwargs)}

                def post(m, args, kwargs, output, name=name):
                    r = rec["ops"][name]
                    if "out" not in r:
                        r["out"] = _clone(output)
                        r["type"] = type(m).__name__
                mod.register_forward_pre_hook(pre, with_kwargs=True)
                mod.register_forward_hook(post, with_kwargs=True)
                n += 1
            if short == "attn" and ".layers." in name:
                rec.setdefault("attn_info", {"impl": type(getattr(mod, "impl", None)).__name__,
                                             "scale": float(getattr(mod, "scale", float("nan"))),
                                             "backend": str(getattr(mod, "attn_backend", "?"))})
        return n

    print("hooked", llm.apply_model(install), flush=True)
    rec["logprobs"] = prompt_logprobs(llm, ids)
    torch.save(rec, out)
    print("captured", len(rec["ops"]), "ops ->", out, rec.get("attn_info"), flush=True)


def main() -> None:
    step, folder, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 256
    if step == "capture":
        capture(folder, out, tokens)
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from serve_model_ops_compare import chain, compare

        (chain if step == "chain" else compare)(folder, out)


if __name__ == "__main__":
    main()
