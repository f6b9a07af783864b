"""``lowbit env``: what a bug report needs (``lowbit --version`` is the root option, lowbit.cli.app)."""

from __future__ import annotations

import json

import typer

from lowbit.cli.app import app


@app.command("env")
def env_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines.")) -> None:
    """Print the versions, CPU features and kernels available here, for a bug report."""
    from lowbit.cli.env_info import collect

    info = collect()
    if as_json:
        print(json.dumps(info, indent=2))
        return
    width = max(map(len, info))
    for k, v in info.items():
        print(f"{k + ':':<{width + 1}} {v}")
