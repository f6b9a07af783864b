"""lowbit: quantize LLM weights and activations with exact numerics.

    import lowbit
    qmodel = lowbit.quantize(model, scheme="w8a8-int8", calibration=texts, smoothquant=0.8)
    lowbit.use_backend(qmodel, "cpu-int8")
"""

from lowbit.backends import use_backend
from lowbit.checkpoint import load, save
from lowbit.model_quant import quantize
from lowbit.modelfree import quantize_checkpoint
from lowbit.schemes import PRESETS, QuantSpec, Scheme, get_scheme

__version__ = "0.1.0"

__all__ = ["quantize", "use_backend", "save", "load", "get_scheme", "PRESETS", "Scheme", "QuantSpec", "__version__"]
