"""Typer application: one sub-command per file in lowbit.cli, errors as one clear line."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from lowbit.errors import LowbitError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Quantize LLM weights and activations with exact numerics.")
console = Console()
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    """``--version``: print ``lowbit <version>`` and exit before any sub-command runs."""
    if value:
        import lowbit

        print(f"lowbit {lowbit.__version__}")
        raise typer.Exit()


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show the Python traceback of an error (any position "
                                                          "on the command line)."),
          version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                       help="Print lowbit's version and exit.")) -> None:
    """lowbit: quantize LLM weights and activations with exact numerics."""


@app.command("schemes")
def schemes_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table.")) -> None:
    """List the preset schemes with their numerics."""
    from lowbit.schemes import PRESETS

    if as_json:
        print(json.dumps({n: s.to_dict() for n, s in PRESETS.items()}, indent=2))
        return
    t = Table(title="lowbit schemes")
    t.add_column("scheme", style="bold")
    t.add_column("weights")
    t.add_column("input activations")
    t.add_column("calibration")
    for n, s in PRESETS.items():
        a = s.input_activations
        acts = "none (weight-only)" if a is None else f"{a.describe()}, {a.dynamic.value}"
        t.add_row(n, s.weights.describe(), acts, "needed" if s.needs_calibration else "-")
    console.print(t)
    from lowbit.formats.gguf.mixes import Mix
    from lowbit.numerics.ggml import GgmlType

    console.print(f"--format gguf (llama.cpp) takes a mix: {', '.join(m.value for m in Mix)}; or one GGML type for "
                  f"every tensor: {', '.join(g.value for g in GgmlType)} (docs/gguf.md)", highlight=False)


def main(argv: list[str] | None = None) -> None:
    """Entry point. A LowbitError or a bad path prints one line and exits 2 (``--debug`` shows
    the traceback); usage errors are Click's own messages."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if debug:
        args.remove("--debug")
    try:
        app(args=args, prog_name="lowbit")
    except (LowbitError, FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError) as e:
        if debug:
            raise
        from rich.markup import escape

        msg = e.cli_message() if isinstance(e, LowbitError) else str(e)
        err_console.print(f"[red]error:[/red] {escape(msg)}", highlight=False, soft_wrap=True)  # one line, never wrapped
        sys.exit(2)


# sub-commands in their own modules (each registers itself on ``app``)
from lowbit.cli import compare_cmd, env_cmd, eval_cmd, inspect_cmd, quantize_cmd  # noqa: E402,F401
