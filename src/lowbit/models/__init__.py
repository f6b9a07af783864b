"""Models lowbit loads: the built-in default (SmolLM2-135M from PyPI) and any HF folder."""

from lowbit.models.builtin import (BUILTIN_NAME, ModelNotFoundError, builtin_gguf_path,
                                   builtin_model_dir, convert_gguf, default_cache_dir,
                                   ensure_builtin, is_quantized_folder, load_model,
                                   resolve_model_path)

__all__ = ["BUILTIN_NAME", "ModelNotFoundError", "builtin_gguf_path", "builtin_model_dir",
           "convert_gguf", "default_cache_dir", "ensure_builtin", "is_quantized_folder",
           "load_model", "resolve_model_path"]
