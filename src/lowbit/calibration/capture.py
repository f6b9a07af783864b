"""Layer-by-layer execution: find the decoder layers, capture the first layer's inputs, run
one layer on captured inputs, observe linear inputs with hooks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn

from lowbit.calls import move_call, slice_call
from lowbit.targets import NON_TEXT_COMPONENTS


class Stop(Exception):
    """Raised by a hook to end a model's forward once what it needs was seen (``run_batches``)."""


def find_decoder_layers(model: nn.Module, linear_names: list[str]) -> tuple[str, nn.ModuleList] | None:
    """The ModuleList of repeated blocks holding the most target linears (text towers only)."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if any(p in NON_TEXT_COMPONENTS for p in name.split(".")):
            continue
        prefix = name + "."
        n = sum(1 for ln in linear_names if ln.startswith(prefix))
        if n and (best is None or n > best[0]):
            best = (n, name, mod)
    return None if best is None else (best[1], best[2])


Inputs = list[tuple[tuple, dict]]


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, layer: nn.Module, tokens: torch.Tensor, batch_size: int,
                         device: torch.device | None = None) -> Inputs:
    """(args, kwargs) of ``layer``'s call for each batch of ``tokens`` (the model stops there);
    the model runs on ``device`` (default: where its first parameter is)."""
    captured: Inputs = []

    def hook(_mod, args, kwargs):
        captured.append((tuple(args), dict(kwargs)))
        raise Stop

    device = device or next(model.parameters()).device
    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        run_batches(model, tokens, batch_size, device)
    finally:
        h.remove()
    if len(captured) != -(-tokens.shape[0] // batch_size):
        raise RuntimeError("could not capture the inputs of the first decoder layer")
    return captured


@torch.no_grad()
def run_batches(model: nn.Module, tokens: torch.Tensor, batch_size: int, device: torch.device) -> None:
    """The model's forward on each batch of ``tokens`` (on ``device``), each ended early where a
    hook raises ``Stop``."""
    for i in range(0, tokens.shape[0], batch_size):
        try:
            model(input_ids=tokens[i:i + batch_size].to(device), use_cache=False)
        except Stop:
            pass


def first_window(inputs: Inputs, device: torch.device | None = None, layout=None) -> tuple[tuple, dict] | None:
    """The first window of the first batch's call (on ``device`` when given), or None without a
    batch: what the probes of one decoder layer's forward run on (its SmoothQuant mappings,
    what its weights are for). ``layout`` (``lowbit.call_layout.CallLayout``, the layer's): where
    the call holds its windows; None: the batch holds one window, or (callers without a capture)
    the first dimension of the hidden states counts them (``lowbit.calls.slice_call``)."""
    if not inputs:
        return None
    if layout is not None:
        return move_call(layout.cut(inputs[0], 0, 1), device)
    return move_call(slice_call(inputs[0], hidden_of(inputs[0]).shape[0], 0, 1), device)


def hidden_of(call: tuple[tuple, dict]) -> torch.Tensor:
    args, kwargs = call
    return args[0] if args else kwargs["hidden_states"]


def output_hidden(out):
    """The hidden states of a decoder layer's output (a tensor, or a tuple that starts with them)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def with_hidden(call: tuple[tuple, dict], h: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = call
    if args:
        return (h,) + tuple(args[1:]), kwargs
    kw = dict(kwargs)
    kw["hidden_states"] = h
    return args, kw


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: Inputs, device: torch.device | None = None) -> list[torch.Tensor]:
    """The layer's hidden-state output for each call; with ``device`` each call runs there and
    its output comes back to the device its inputs were on (activations offloaded to the CPU)."""
    outs = []
    for call in inputs:
        args, kwargs = move_call(call, device)
        out = output_hidden(layer(*args, **kwargs))
        outs.append(out if device is None else out.to(hidden_of(call).device))
    return outs


@contextmanager
def observing(modules: dict[str, nn.Module], fn: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(name, input)`` on every forward of each module."""
    handles = []
    for name, mod in modules.items():
        handles.append(mod.register_forward_pre_hook(lambda _m, args, _n=name: fn(_n, args[0])))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def observe_layer(layer: nn.Module, inputs: Inputs, modules: dict[str, nn.Module],
                  fn: Callable[[str, torch.Tensor], None], device: torch.device | None = None) -> None:
    """Run ``layer`` on each batch of ``inputs`` for its observations only: ``fn(name, input)``
    on each forward of each module, and the batch stops as soon as every module has been
    called in it (what follows, e.g. the last linear's product and the residual, feeds nothing
    observed here). Each module is assumed to run at most once per layer call, as the linears
    of a decoder layer do; a module that does not run in a batch (an MoE expert no token is
    routed to) lets the batch run to its end. ``device``: as for ``run_layer``."""
    seen: set[str] = set()

    def hook(name: str, x: torch.Tensor) -> None:
        fn(name, x)
        seen.add(name)
        if len(seen) == len(modules):
            raise Stop

    with observing(modules, hook):
        for call in inputs:
            seen.clear()
            args, kwargs = move_call(call, device)
            try:
                layer(*args, **kwargs)
            except Stop:
                pass


def batch_masks(valid: torch.Tensor | None, tokens: torch.Tensor, batch_size: int) -> list[torch.Tensor] | None:
    """``valid`` [n, T] (the positions that count; None: all) cut into the batches of ``tokens``."""
    if valid is None:
        return None
    if tuple(valid.shape) != tuple(tokens.shape):
        raise ValueError(f"valid {tuple(valid.shape)} does not match tokens {tuple(tokens.shape)}")
    return [valid[i:i + batch_size] for i in range(0, tokens.shape[0], batch_size)]


@torch.no_grad()
def observe_batches(layer: nn.Module, inputs: Inputs, modules: dict[str, nn.Module],
                    fn: Callable[[str, torch.Tensor, torch.Tensor | None], None],
                    masks: list[torch.Tensor] | None = None, device: torch.device | None = None,
                    outputs: bool = False) -> list[torch.Tensor] | None:
    """``observe_layer`` one batch at a time, ``fn(name, input, mask)`` given each batch's mask
    (``masks[i]``; None: every position counts); with ``outputs`` each batch runs to the layer's
    end (``run_layer``) and the outputs are returned, else None."""
    outs: list[torch.Tensor] = []
    for call, mask in zip(inputs, masks if masks is not None else [None] * len(inputs)):
        f = lambda n, x, _m=mask: fn(n, x, _m)  # noqa: E731
        if outputs:
            with observing(modules, f):
                outs += run_layer(layer, [call], device)
        else:
            observe_layer(layer, [call], modules, f, device)
    return outs if outputs else None
