"""Layer by layer: what vLLM's CPU int8 and FP8 linears compute, against lowbit and an exact float64
reading of the checkpoint (issue 21). Two steps, two venvs (as bench/serve/serve_vllm.py):

    .venv-vllm/bin/python bench/serve/serve_layers.py capture FOLDER OUT.pt [--tokens 512]
    .venv/bin/python      bench/serve/serve_layers.py compare FOLDER OUT.pt

``capture`` serves FOLDER in bfloat16, runs one prompt of the first ``--tokens`` tokens of the
packaged evaluation text and records, for every quantized linear of the first decoder layers,
its input (bf16), its output (bf16), the input scale vLLM holds after loading and the int8 codes
vLLM's own quantization op (``torch.ops._C.static/dynamic_scaled_int8_quant``; for FP8 layers the
kernel's ``QuantFP8``) gives that input.

``compare`` reads the same layers from FOLDER and, on vLLM's captured input, computes:
  - exact: the checkpoint's meaning in float64 (codes = clamp(rne(x / s)), exact int accumulator,
    y = acc * s_x * s_w + b), and its bf16 rounding;
  - lowbit: the cpu-int8 backend (float32, x / s), and the serving emulation
    (lowbit.quant.serving, ServingNumerics.VLLM_CPU);
and prints per layer: codes differing (vLLM op vs lowbit vs exact), and the max / rms relative
difference of vLLM's output against each.
"""

from __future__ import annotations

import sys
from pathlib import Path

LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def capture(folder: str, out: str, tokens: int, first_layers: int) -> None:
    import torch

    from serve_common import prompt_logprobs, served_prompt

    llm, ids = served_prompt(folder, tokens)
    rec: dict = {"ids": ids, "layers": {}}

    def install(model):
        hooks = []
        for name, mod in model.named_modules():
            short = name.rsplit(".", 1)[-1]
            if short not in LAYERS or ".layers." not in name:
                continue
            idx = int(name.split(".layers.")[1].split(".")[0])
            if idx >= first_layers:
                continue

            def hook(m, args, output, name=name):
                x = args[0].detach().clone()
                y = (output[0] if isinstance(output, tuple) else output).detach().clone()
                i_s = getattr(m, "input_scale", None)
                r = {"x": x, "y": y, "input_scale": None if i_s is None else i_s.detach().float().clone(),
                     "logical_widths": list(getattr(m, "logical_widths", []))}
                x2 = x.reshape(-1, x.shape[-1]).contiguous()
                fp8 = getattr(getattr(m, "scheme", None), "fp8_linear", None)
                if fp8 is not None:  # FP8: the values and scales of the kernel's own QuantFP8 op
                    q8, s8 = fp8.quant_fp8(x2, None, None)
                    r["codes"], r["token_scale"] = q8[: x2.shape[0]].float(), s8[: x2.shape[0]].float()
                    r["kernel"] = type(fp8).__name__
                    rec["layers"].setdefault(name, r)
                    return
                q = torch.empty_like(x2, dtype=torch.int8)
                if i_s is not None:
                    torch.ops._C.static_scaled_int8_quant(q, x2, i_s.reshape(()).float().contiguous(), None)
                else:
                    s = torch.empty((x2.shape[0], 1), dtype=torch.float32)
                    torch.ops._C.dynamic_scaled_int8_quant(q, x2, s, None)
                    r["token_scale"] = s
                r["codes"] = q
                kernel = getattr(getattr(m, "scheme", None), "kernel", None)
                r["kernel"] = type(kernel).__name__ + "." + getattr(getattr(kernel, "linear_method", None),
                                                                     "__name__", "?")
                rec["layers"].setdefault(name, r)
            hooks.append(mod.register_forward_hook(hook))
        return len(hooks)

    print("hooked", llm.apply_model(install), flush=True)
    rec["logprobs"] = prompt_logprobs(llm, ids)
    torch.save(rec, out)
    print("captured", len(rec["layers"]), "layers ->", out, flush=True)


def main() -> None:
    step, folder, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 512
    first = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 30
    if step == "capture":
        capture(folder, out, tokens, first)
    else:
        sys.path.insert(0, str(Path(__file__).parent))
        from serve_layers_compare import compare
        from serve_layers_fp8 import compare_fp8, is_fp8

        (compare_fp8 if is_fp8(folder) else compare)(folder, out)


if __name__ == "__main__":
    main()
