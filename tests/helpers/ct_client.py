"""A script that loads compressed-tensors folders with transformers alone (run as ``python -c CLIENT``):
lowbit is never imported there."""

import textwrap

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
