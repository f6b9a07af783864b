"""Compile the kernels for an NVIDIA target without a GPU and list their float instructions.

Bit-exactness on the GPU rests on the PTX using only IEEE round-to-nearest float32 operations
that keep subnormals: ``div.rn.f32`` and ``mul.rn.f32``, no ``.ftz`` variant, no approximate
division or reciprocal, no FMA contraction. ``audit()`` compiles every kernel variant the
package launches (Triton compiles to PTX on any host) and returns the float instructions it
finds; ``violations()`` names the forbidden ones. Run it in a process where TRITON_INTERPRET is
unset (``python -m lowbit.kernels.ptx_audit``).
"""

from __future__ import annotations

import json
import re
import sys

import torch

FLOAT_OP = re.compile(r"\b((?:div|mul|add|sub|fma|rcp|sqrt|max|min|cvt|mad|ex2|lg2)\.[a-z0-9.]*f(?:16|32|64)[a-z0-9.]*)")
FORBIDDEN = re.compile(r"\.ftz|div\.full|div\.approx|rcp\.approx|^fma\.|^mad\.")


def _compile(fn, signature: dict, constexprs: dict, capability: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"enable_fp_fusion": False})
    return k.asm["ptx"]


def variants():
    """(name, kernel, signature, constexprs) for each kernel variant lowbit launches."""
    from lowbit.kernels import actquant as A, dequant as D
    from lowbit.schemes import get_scheme

    out = []
    bsig = {"x_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*fp32", "scode_ptr": "*u8", "qdq_ptr": "*i16",
            "gs_ptr": "*fp32", "flag_ptr": "*i32", "n_blocks": "i32"}
    for name in ("nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8"):
        spec = get_scheme(name).input_activations
        out.append((f"block_quant[{name}]", A._block_quant_kernel, bsig,
                    A.block_quant_constexprs(spec, codes=True, qdq_dtype=torch.bfloat16)))
    rsig = {"x_ptr": "*fp32", "codes_ptr": "*u8", "scale_ptr": "*fp32", "static_ptr": "*fp32", "flag_ptr": "*i32",
            "M": "i32", "K": "i32"}
    for name in ("w8a8-int8-dynamic", "w8a8-fp8"):
        out.append((f"row_quant[{name}]", A._row_quant_kernel, rsig,
                    A.row_quant_constexprs(get_scheme(name).input_activations)))
    dsig = {"w_ptr": "*u8", "scode_ptr": "*u8", "gs_ptr": "*fp32", "out_ptr": "*i16", "n_blocks": "i32"}
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        out.append((f"mx_dequant[{name}]", D._mx_dequant_kernel, dsig,
                    D.mx_dequant_constexprs(get_scheme(name).weights, torch.bfloat16)))
    isig = {"w_ptr": "*i32", "scale_ptr": "*fp32", "zp_ptr": "*i8", "out_ptr": "*i16", "N": "i32", "K": "i32",
            "n_groups": "i32", "group_size": "i32", "words_per_row": "i32"}
    out.append(("int_dequant[w4a16]", D._int_dequant_kernel, isig,
                D.int_dequant_constexprs(get_scheme("w4a16").weights, torch.bfloat16, True)))
    from lowbit.kernels import epilogue as Ep

    esig = {"acc_ptr": "*i32", "sx_ptr": "*fp32", "sw_ptr": "*fp32", "b_ptr": "*bf16", "y_ptr": "*i16", "M": "i32",
            "N": "i32"}
    out.append(("scale_epilogue[int8]", Ep._scale_epilogue_kernel, esig,
                dict(SX_PER_ROW=True, HAS_BIAS=True, OUT_BF16=True, BLOCK_M=32, BLOCK_N=128)))
    return out


def audit(capability: int = 90, names: list[str] | None = None) -> dict[str, list[str]]:
    """Sorted distinct float instructions in the PTX of each kernel variant."""
    found = {}
    for name, fn, sig, cx in variants():
        if names is not None and name not in names:
            continue
        ptx = _compile(fn, sig, cx, capability)
        found[name] = sorted(set(FLOAT_OP.findall(ptx)))
    return found


def violations(found: dict[str, list[str]]) -> dict[str, list[str]]:
    bad = {k: [op for op in v if FORBIDDEN.search(op)] for k, v in found.items()}
    return {k: v for k, v in bad.items() if v}


if __name__ == "__main__":  # prints JSON: {"instructions": {...}, "violations": {...}}
    names = sys.argv[1:] or None
    f = audit(names=names)
    print(json.dumps({"instructions": f, "violations": violations(f)}))
