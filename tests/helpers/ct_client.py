"""A script that loads compressed-tensors folders with transformers alone (run as ``python -c CLIENT``):
lowbit is never imported there."""

import json
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import load_file, save_file

CLIENT = textwrap.dedent("""
    import json, sys
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    jobs = json.loads(sys.argv[1])
    ids = load_file(jobs["ids"])["ids"]
    out = {}
    for name, (folder, dtype) in jobs["folders"].items():
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        assert type(m.model.layers[0].self_attn.q_proj) is torch.nn.Linear
        with torch.no_grad():
            out[name] = m(ids).logits.float().contiguous()
    save_file(out, jobs["out"])
    assert not any(k == "lowbit" or k.startswith("lowbit.") for k in sys.modules), "lowbit was imported"
""")


def client_logits(tmp_path, ids: torch.Tensor, folders: dict[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
    """Logits of ``ids`` from each folder ({name: (folder, dtype name)}) as the CLIENT subprocess
    computes them."""
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    jobs = {"ids": str(tmp_path / "ids.safetensors"), "out": str(tmp_path / "logits.safetensors"), "folders": folders}
    p = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return load_file(str(tmp_path / "logits.safetensors"))


def assert_close_logits(got: dict, refs: dict, cases: dict) -> None:
    """Each case's max |diff| within its tolerance (the last field of ``cases[name]``) of max |logit|."""
    for name, case in cases.items():
        rel = case[-1]
        diff = (got[name] - refs[name]).abs().max().item()
        scale = refs[name].abs().max().item()
        print(f"{name}: max |diff| {diff:.4g}, max |logit| {scale:.4g}")
        assert diff <= rel * scale, (name, diff, scale)
