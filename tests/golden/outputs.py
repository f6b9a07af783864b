"""The bytes lowbit writes, as digests: every preset scheme x checkpoint format, in memory and
model-free, on one tiny model. ``test_output_digests.py`` compares them with
``output_digests.json``, so a refactor that claims to change no behaviour proves it.

What is digested, per written folder: each tensor (name -> sha256 of dtype, shape and raw bytes)
and each JSON file (sha256 of its canonical form without ``transformers_version``). Where the
host's float sums decide a value, only its name, dtype and shape are digested: the static input
scales of calibrated schemes, as tensors or in a fake checkpoint's config (the calibration's forward
runs through GEMMs, whose last bits differ between AVX2 and AVX-512 hosts). Calibrated schemes are quantized with RTN weights and no
SmoothQuant, so their weights do not depend on the forward either. A scheme x format the format
refuses is recorded as the error's class and first line.

Regenerate after an intended change (and say why in the commit):

    .venv/bin/python tests/golden/outputs.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DIGESTS = HERE / "output_digests.json"
FORMATS = ("lowbit", "fake", "compressed-tensors")
DIMS = {"hidden_size": 128, "intermediate_size": 256}
#: tensors whose values come from the calibration's forward (host-dependent float sums)
FORWARD_DEPENDENT = ("input_scale", "input_global_scale", "input_zero_point")


def _tensor_digest(name: str, t, values: bool) -> str:
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    if values:
        h.update(t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def _scrub(obj):
    """JSON with forward-dependent values (a fake checkpoint's static scales) replaced by their kind."""
    if isinstance(obj, dict):
        return {k: (type(v).__name__ if k in FORWARD_DEPENDENT else _scrub(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    return obj


def folder_digests(folder: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out = {}
    for p in sorted(folder.iterdir()):
        if p.suffix == ".safetensors":
            for name, t in sorted(load_file(str(p)).items()):
                values = not name.endswith(FORWARD_DEPENDENT)
                out[f"{p.name}:{name}"] = _tensor_digest(name, t, values)
        elif p.suffix == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                data.pop("transformers_version", None)
            out[p.name] = hashlib.sha256(json.dumps(_scrub(data), sort_keys=True).encode()).hexdigest()
    return out


def _calibration_ids():
    import torch

    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def _quantized(scheme: str):
    import lowbit
    from helpers.models import tiny_llama
    from lowbit.method import calibrates
    from lowbit.calibration import CalibrationConfig
    from lowbit.schemes import get_scheme

    model = tiny_llama(**DIMS)
    s = get_scheme(scheme)
    cfg = CalibrationConfig(num_samples=4, seq_len=32, weight_rounding="rtn", reconstruct_iters=0)
    if calibrates(s, None, cfg):
        return lowbit.quantize(model, s, calibration=_calibration_ids(), smoothquant=None, progress=False,
                               num_samples=4, seq_len=32, weight_rounding="rtn", reconstruct_iters=0)
    return lowbit.quantize(model, s, smoothquant=None)


def _record(fn) -> dict:
    from lowbit.errors import LowbitError

    try:
        return {"files": folder_digests(fn())}
    except (LowbitError, NotImplementedError) as e:
        return {"refused": f"{type(e).__name__}: {str(e).splitlines()[0]}"}


def all_digests() -> dict[str, dict]:
    """``{"in-memory/<scheme>/<format>": {...}, "model-free/<scheme>/<format>": {...}}``."""
    import lowbit
    from helpers.eval_fixtures import save_tiny_folder
    from lowbit.modelfree import quantize_model_free
    from lowbit.schemes import PRESETS

    work = Path(tempfile.mkdtemp(prefix="lowbit-golden-"))
    src = save_tiny_folder(work / "src", **DIMS)
    out: dict[str, dict] = {}
    for scheme in PRESETS:
        q = _quantized(scheme)
        for fmt in FORMATS:
            dest = work / "mem" / scheme / fmt
            out[f"in-memory/{scheme}/{fmt}"] = _record(lambda: lowbit.save(q, dest, format=fmt))
            dest_mf = work / "mf" / scheme / fmt
            out[f"model-free/{scheme}/{fmt}"] = _record(
                lambda: quantize_model_free(src, dest_mf, scheme=scheme, format=fmt, workers=1, progress=False))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: outputs.py --write")
    DIGESTS.write_text(json.dumps(all_digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DIGESTS}")
