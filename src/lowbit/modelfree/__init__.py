"""Model-free quantization: straight from safetensors shards, bounded memory, parallel, resumable.

    lowbit.quantize_checkpoint("./model", "./out", scheme="nvfp4-e5m3", format="lowbit", workers=2)
"""

from lowbit.modelfree.plan import make_plan
from lowbit.modelfree.plan_types import Kind, Plan
from lowbit.modelfree.run import check_model_free_scheme, quantize_model_free
from lowbit.modelfree.source import Checkpoint
from lowbit.modelfree.options import RunOptions

__all__ = ["quantize_model_free", "RunOptions", "check_model_free_scheme", "make_plan", "Plan", "Kind", "Checkpoint"]
