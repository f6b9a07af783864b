"""What a quantization run quantized, as ``lowbit quantize`` reports it: linears, weights, MoE
experts and the spread of the experts' static input scales (``quantized_summary``), per model
or per decoder layer (``merge_summaries`` adds per-layer summaries up)."""

from __future__ import annotations


def quantized_summary(model) -> dict:
    """What was quantized: lowbit layers and their weight parameters, against every parameter."""
    from lowbit.modules import QuantLinear
    from lowbit.report.layers import quantized_linears
    from lowbit.moe import expert_blocks

    named = quantized_linears(model)
    layers = list(named.values())
    q_params = sum(m.out_features * m.in_features for m in layers)
    float_params = sum(p.numel() for p in model.parameters())
    blocks = expert_blocks(model)
    experts = sum(1 for b in blocks.values() for e in range(len(b))
                  if any(isinstance(m, QuantLinear) for m in b[e].modules()))
    in_experts = sum(1 for n in named if any(n.startswith(f"{b}.") for b in blocks))
    from lowbit.recipes.weight_bits import average_bits

    schemes: dict[str, int] = {}
    for m in layers:
        schemes[m.scheme.name] = schemes.get(m.scheme.name, 0) + 1
    avg = average_bits({n: (m.out_features, m.in_features) for n, m in named.items()},
                       {n: m.scheme for n, m in named.items()}) if named else None
    return {"linears": len(layers), "weight_parameters": q_params, "float_parameters": float_params,
            "schemes": schemes, "average_bits": avg,
            "moe_blocks": len(blocks), "experts": experts, "expert_linears": in_experts,
            "expert_input_scale_spread": expert_scale_spread(blocks),
            "unquantized_targets": list(getattr(model, "lowbit_unquantized", [])),
            "float_weights": float_weight_kinds(getattr(model, "lowbit_float_weights", {})),
            "rotation": rotation.describe() if (rotation := getattr(model, "lowbit_rotation", None)) else None}


def float_weight_kinds(float_weights: dict[str, str]) -> dict[str, int]:
    """kind -> count of the weights that are not targets and stay in float (``targets.float_weights``)."""
    out: dict[str, int] = {}
    for kind in float_weights.values():
        out[kind] = out.get(kind, 0) + 1
    return out


def expert_scale_spread(blocks: dict) -> dict[str, float]:
    """Static input scales per expert (what vLLM's MoE kernels take): per projection, the largest
    max/min ratio of the experts' scales within one block (1.0: all experts share one scale)."""
    from lowbit.modules import QuantLinear

    out: dict[str, float] = {}
    for block in blocks.values():
        for proj, _ in block[0].named_children():
            vals = []
            for e in range(len(block)):
                m = getattr(block[e], proj, None)
                s = None if not isinstance(m, QuantLinear) else (m.input_scale if m.input_scale is not None
                                                                 else m.input_global_scale)
                if s is not None:
                    vals.append(float(s.reshape(-1).float().abs().max()))
            if len(vals) > 1 and min(vals) > 0:
                out[proj] = max(out.get(proj, 1.0), max(vals) / min(vals))
    return out


def merge_summaries(parts: list[dict], float_parameters: int, unquantized: list[str]) -> dict:
    """One summary of a model quantized in parts (decoder layers, each summarised alone): counts
    added, spreads the largest; ``float_parameters`` of the parts outside them added."""
    out = {"linears": 0, "weight_parameters": 0, "float_parameters": float_parameters, "moe_blocks": 0, "experts": 0,
           "expert_linears": 0, "expert_input_scale_spread": {}, "unquantized_targets": list(unquantized),
           "float_weights": {},
           "rotation": None}  # a streamed run never rotates (lowbit.streamed.api)
    for p in parts:
        for k in ("linears", "weight_parameters", "float_parameters", "moe_blocks", "experts", "expert_linears"):
            out[k] += p[k]
        for proj, v in p["expert_input_scale_spread"].items():
            out["expert_input_scale_spread"][proj] = max(out["expert_input_scale_spread"].get(proj, 1.0), v)
    return out
