"""lowbit: quantize LLM weights and activations with exact numerics.

    import lowbit
    model, tok = lowbit.load_model()        # the built-in SmolLM2-135M (or a model folder)
    qmodel = lowbit.quantize(model, scheme="w8a8-int8", calibration="builtin", tokenizer=tok)
    lowbit.use_backend(qmodel, "cpu-int8")

The public names are imported when first used, so ``import lowbit`` (and the CLI's ``--help``
and its errors) do not import torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the module that defines it
_PUBLIC = {
    "quantize": "lowbit.model_quant",
    "use_backend": "lowbit.backends",
    "save": "lowbit.checkpoint",
    "load": "lowbit.checkpoint",
    "load_model": "lowbit.models",
    "quantize_checkpoint": "lowbit.checkpoint_api",
    "quantize_gguf": "lowbit.gguf_quantize",
    "get_scheme": "lowbit.schemes",
    "PRESETS": "lowbit.schemes",
    "Scheme": "lowbit.schemes",
    "QuantSpec": "lowbit.schemes",
    "Recipe": "lowbit.recipes",
    "auto_recipe": "lowbit.recipes.auto",
}

__all__ = ["quantize", "use_backend", "save", "load", "load_model", "quantize_checkpoint", "quantize_gguf", "get_scheme",
           "PRESETS",
           "Scheme", "QuantSpec", "Recipe", "auto_recipe", "__version__"]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a subpackage, e.g. lowbit.models
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
