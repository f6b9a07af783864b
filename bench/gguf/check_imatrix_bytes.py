"""lowbit's weighted encoders against ``llama-quantize --imatrix``, byte for byte, on a whole file.

Given llama-imatrix's own importance file (``imatrix.gguf``: per GGUF tensor ``<name>.in_sum2`` and
``<name>.counts``), lowbit writes the mix with those vectors (normalised as llama-quantize
normalises them: sum / count in float32) and the file is compared tensor by tensor with
llama-quantize's output from the same float32 GGUF and imatrix.

    python bench/gguf/check_imatrix_bytes.py --llama BIN --out bench/gguf/out --mixes Q4_K_M,Q3_K_M,Q2_K

(``--out`` is bench_gguf.py's folder: it reuses ``model-f32.gguf``, ``imatrix.gguf`` and
``llama-<MIX>-imatrix.gguf``, and quantizes them again when missing.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


def importance_from_imatrix(path: Path, plan) -> dict:
    """HF weight name -> float32 [in] (or [E, in]) from llama-imatrix's file, through the plan's
    row maps (a GGUF tensor made of one HF tensor gets its vector)."""
    import gguf
    import torch

    r = gguf.GGUFReader(path)
    t = {x.name: torch.from_numpy(x.data.copy()).to(torch.float32) for x in r.tensors}
    out = {}
    for rm in plan.rowmaps().values():
        sums, counts = t.get(f"{rm.name}.in_sum2"), t.get(f"{rm.name}.counts")
        if sums is None or len(rm.sources) != 1:
            continue
        n = counts.numel()
        s = sums.reshape(n, -1)
        e = torch.where(counts.reshape(n, 1) > 0, s / counts.reshape(n, 1), torch.ones_like(s))
        out[rm.sources[0]] = e[0] if n == 1 else e
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama", required=True)
    ap.add_argument("--out", default="bench/gguf/out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--mixes", default="Q4_K_M,Q3_K_M,Q2_K")
    a = ap.parse_args()

    from bench_gguf import compare_files

    from lowbit.files.folder import SafetensorsFolder
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.formats.gguf.mixes import Mix
    from lowbit.formats.gguf.writer import write_gguf
    from lowbit.formats import Format, get_format
    from lowbit.numerics.ggml import ImportanceSearch
    from lowbit.models import resolve_model_path

    out = Path(a.out)
    src = resolve_model_path(a.model)
    plan = plan_gguf(src)
    imp = importance_from_imatrix(out / "imatrix.gguf", plan)
    results = {}
    for mix in a.mixes.split(","):
        theirs = out / f"llama-{mix}-imatrix.gguf"
        if not theirs.exists():
            subprocess.run([str(Path(a.llama) / "llama-quantize"), "--imatrix", str(out / "imatrix.gguf"),
                            str(out / "model-f32.gguf"), str(theirs), mix, "2"], check=True, capture_output=True)
        ours = out / f"lowbit-{mix}-llama-imatrix.gguf"
        types = get_format(Format.GGUF).tensor_types(plan, Mix(mix), True)
        write_gguf(plan, ours, SafetensorsFolder(src), types, file_type=Mix(mix), importance=imp,
                   search=ImportanceSearch.LLAMA_CPP)  # llama-quantize --imatrix's search, its bytes
        results[mix] = compare_files(ours, theirs)
        print(mix, results[mix])
    (out / "imatrix_bytes.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
