"""Mixture-of-experts blocks: transformers' fused 3-D experts split into one linear per expert
projection, so that every expert is quantized, calibrated, saved and loaded like any linear.

transformers 5 holds a block's experts as fused parameters (``experts.gate_up_proj`` [E, 2I, H],
``experts.down_proj`` [E, H, I]; gpt-oss transposed, interleaved and with biases).
``split_experts(model)`` replaces each such module by ``SplitExperts``: expert e is
``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (``nn.Linear``, the per-expert names the
checkpoints use), computing exactly what the fused module computes. ``all_tokens(module)`` makes
every expert of the blocks under ``module`` see every token (for calibration statistics) while
the block's output keeps the real routing. ``naming`` holds the checkpoint key conventions
(Mixtral's legacy ``block_sparse_moe.experts.{e}.w1/w2/w3``).
"""

from lowbit.moe.experts import ExpertMLP, GateKind, SplitExperts
from lowbit.moe.naming import FUSED_ON_DISK, checkpoint_names, model_names
from lowbit.moe.slices import FusedLayout, Proj, expert_part, part_shape
from lowbit.moe.split import (
    all_tokens, expert_blocks, is_fused_experts, router_names, same_input_groups, split_experts,
)

__all__ = [
    "ExpertMLP", "GateKind", "SplitExperts", "split_experts", "all_tokens", "expert_blocks", "is_fused_experts",
    "router_names", "same_input_groups", "checkpoint_names", "model_names", "FUSED_ON_DISK", "FusedLayout",
    "Proj", "expert_part", "part_shape",
]
