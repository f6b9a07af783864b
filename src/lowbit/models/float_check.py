"""Checking a float model folder before transformers reads it (the calibrated path's input).

    folder = check_float_folder(path)   # SafetensorsFolder; FormatError naming the file or tensor

transformers' own loader prints tracebacks for damaged folders, follows an index's shard names
outside the folder, unpickles ``pytorch_model.bin`` files and casts integer tensors into float
parameters silently. This reads the folder as lowbit.load and model-free quantization do
(lowbit.files.folder: config.json is JSON; shard names are plain file names in the folder; every
shard header agrees with its file size) and compares every stored tensor with the model the config
describes, built on the meta device (no memory, no data): its shape must match, and a float
parameter must be stored in a float dtype (F32, F16 or BF16, FLOAT_DTYPE_CODES: the same rule as
model-free quantization). Only safetensors weights are read, never pickled ``.bin`` files.
"""

from __future__ import annotations

from pathlib import Path

from lowbit.errors import FormatError
from lowbit.files.folder import FLOAT_DTYPE_CODES, SafetensorsFolder, read_config


def _meta_state(folder: Path) -> tuple[dict, str]:
    """(state dict of the config's model on the meta device, its base_model_prefix)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(str(folder))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # transformers raises ValueError/KeyError/OSError/TypeError for bad configs
        raise FormatError(f"{str(folder / 'config.json')!r}: transformers cannot build a model from it: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    return model.state_dict(), getattr(model, "base_model_prefix", "") or ""


def check_float_folder(path: str | Path) -> SafetensorsFolder:
    """The folder's safetensors, checked against its config.json (see the module docstring).
    FormatError naming the file, shard or tensor for anything transformers would misread."""
    folder = Path(path)
    read_config(folder)
    st = SafetensorsFolder(folder)
    expected, prefix = _meta_state(folder)
    for key, ref in expected.items():
        name = key if key in st else key.removeprefix(prefix + ".") if prefix else key
        if name not in st:
            continue  # tied or renamed weights: transformers' own rules decide
        dtype, shape, shard = st.info(name)
        if tuple(shape) != tuple(ref.shape):
            raise FormatError(f"tensor {name!r} in {shard} has shape {tuple(shape)}, the model config says "
                              f"{tuple(ref.shape)} ({str(folder / 'config.json')!r} and the weights disagree)")
        if ref.dtype.is_floating_point and dtype not in FLOAT_DTYPE_CODES:
            raise FormatError(f"tensor {name!r} in {shard} has dtype {dtype}; lowbit quantizes float weights "
                              f"({', '.join(sorted(FLOAT_DTYPE_CODES))}) only")
    return st
