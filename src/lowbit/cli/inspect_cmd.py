"""``lowbit inspect PATH``: format, scheme per layer group, ignored layers, size, inconsistencies."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from lowbit.cli.app import app, console
from lowbit.cli.common import check_folder, human_bytes


def _mb(n: int | None) -> str:
    return "?" if n is None else human_bytes(n)


@app.command("inspect")
def inspect_cmd(
    path: str = typer.Argument(..., help="A checkpoint folder (lowbit, fake, compressed-tensors or auto-round)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    strict: bool = typer.Option(False, "--strict", help="Exit with status 1 when an inconsistency is found."),
) -> None:
    """Show a quantized checkpoint's format, schemes, ignored layers, size and problems (a .gguf
    file: the GGML type of every tensor, from its header)."""
    from pathlib import Path

    from lowbit.models.builtin import is_gguf_path

    if is_gguf_path(Path(path)):  # by its magic bytes, whatever its name
        _inspect_gguf(path, as_json)
        return
    check_folder(path)
    from lowbit.checkpoint.inspect import inspect_checkpoint

    r = inspect_checkpoint(path)
    if as_json:
        print(json.dumps(r, indent=2))
    else:
        console.print(f"[bold]{r['path']}[/bold]: format [bold]{r['format']}[/bold] ({r['source']}), "
                      f"dtype {r['dtype']}", highlight=False)
        t = Table(title="layer groups")
        for col in ("scheme", "layers", "weights", "input activations", "targets"):
            t.add_column(col)
        for g in r["groups"]:
            targets = ", ".join(g["targets"][:3]) + (" ..." if len(g["targets"]) > 3 else "")
            t.add_row(g["scheme"], str(g["layers"]), g["weights"], g["input_activations"] or "none (weight-only)",
                      targets)
        console.print(t)
        if r.get("experts"):
            n_exp = sum(b["experts"] for b in r["experts"].values())
            n_q = sum(b["quantized"] for b in r["experts"].values())
            per = sorted({b["experts"] for b in r["experts"].values()})
            console.print(f"MoE: {len(r['experts'])} expert blocks of {'/'.join(map(str, per))} experts; "
                          f"{n_q} of {n_exp} experts quantized", highlight=False)
        kv = r.get("kv_cache")
        if kv is not None:
            console.print(f"KV cache: {kv['scheme']} ({kv['description']}), k_scale/v_scale on "
                          f"{len(kv['scales'])} of {kv['attention_modules']} attention modules", highlight=False)
        else:
            console.print("KV cache: float (not quantized)", highlight=False)
        ignored = r["ignored"]
        console.print(f"ignored (float) layers: {', '.join(ignored) if ignored else 'none'}", highlight=False)
        if r.get("average_bits") is not None:
            console.print(f"average weight bits (codes + scales) of the quantized linears: {r['average_bits']:.3f}",
                          highlight=False)
        ratio = "" if r["ratio"] is None else f" ({r['ratio']:.3f}x)"
        console.print(f"weights on disk {_mb(r['size_on_disk'])} vs float {_mb(r['float_size'])}{ratio}",
                      highlight=False)
        if r["inconsistencies"]:
            console.print(f"[red]{len(r['inconsistencies'])} inconsistencies:[/red]")
            for p in r["inconsistencies"]:
                console.print(f"  - {p}", highlight=False, soft_wrap=True)
        else:
            console.print("[green]no inconsistencies found[/green]")
    if strict and r["inconsistencies"]:
        raise typer.Exit(1)


def _inspect_gguf(path: str, as_json: bool) -> None:
    """The GGML type of every tensor of a GGUF file (header only) and a count per type."""
    from collections import Counter

    from lowbit.formats.gguf.read import file_tensor_types

    types = file_tensor_types(path)
    counts = dict(Counter(types.values()))
    if as_json:
        print(json.dumps({"path": path, "format": "gguf", "types": counts, "tensors": types}, indent=2))
        return
    t = Table(title=f"{path}: GGUF tensors by GGML type")
    t.add_column("type")
    t.add_column("tensors", justify="right")
    t.add_column("e.g.")
    for kind, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        t.add_row(kind, str(n), next(k for k, v in types.items() if v == kind))
    console.print(t)
