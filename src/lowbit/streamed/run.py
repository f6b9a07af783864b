"""The streamed calibrated run: skeleton, calibration tokens, the layer loop, the output."""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.errors import QuantizationError
from lowbit.schemes import Scheme


def _tokenizer_for(src: Path, calibration, tokenizer):
    """The tokenizer to tokenize text with and to write into the output: the one given, else the
    source folder's (None for token ids when the folder has none)."""
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError, KeyError, TypeError):
        if isinstance(calibration, torch.Tensor):
            return None
        from lowbit.errors import FormatError

        raise FormatError(f"{str(src)!r} has no tokenizer transformers can load, and calibration text needs one "
                          f"(pass tokenizer=..., or token ids)") from None


def local_batches(tokens: torch.Tensor, batch_size: int, group) -> torch.Tensor:
    """This rank's calibration windows: whole batches of ``batch_size`` (the batches one process
    would run), a contiguous share of them per rank (``Group.share``)."""
    n_batches = -(-tokens.shape[0] // batch_size)
    share = group.share(n_batches)
    if len(share) == 0:
        return tokens[:0]
    return tokens[share.start * batch_size:min(tokens.shape[0], share.stop * batch_size)]


def streamed(src: Path, out: Path, scheme: Scheme, fmt, sq, smoothquant, cfg, calibration, tokenizer,
             ignore: list[str], allow_unquantized: bool, resume: bool, overwrite: bool, progress, device,
             offload: bool):
    from lowbit.calibration import LayerwiseCalibrator, calibration_tokens
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.dist import Group
    from lowbit.files.outguard import check_not_source
    from lowbit.files.writer import check_output_free
    from lowbit.model_quant import check_targets
    from lowbit.modelfree.device import resolve_device
    from lowbit.streamed.api import StreamResult, fingerprint, peak_rss_bytes
    from lowbit.streamed.output import StreamOutput, ignore_list
    from lowbit.streamed.skeleton import Skeleton
    from lowbit.streamed.stream import LayerStream
    from lowbit.targets import quantizable_linears

    dev = resolve_device(device)
    check_not_source(src, out)
    check_output_free(out, overwrite)
    group = Group.join(dev)
    skel = Skeleton.open(src)
    model = skel.model
    left = check_targets(model, ignore, False, allow_unquantized)
    tok = _tokenizer_for(src, calibration, tokenizer)
    tokens = calibration_tokens(calibration, tok, num_samples=cfg.num_samples, seq_len=cfg.seq_len)
    names = quantizable_linears(model, ignore, False)
    found = find_decoder_layers(model, names)
    if found is None:
        raise QuantizationError(f"{src}: no decoder layers were found to stream; quantize it in memory "
                                f"(lowbit.quantize, then lowbit.save)")
    path, layers = found
    outside = [n for n in names if not n.startswith(path + ".")]
    if outside:
        raise QuantizationError(f"{src}: linears outside the decoder layers ({', '.join(outside[:3])}) are not "
                                f"streamed yet; add them to ignore, or quantize in memory")
    fp = fingerprint(src, skel.ckpt, scheme, fmt, tokens, cfg, sq, ignore, group.world, dev)
    group.agree("the run's arguments (fingerprint)", fp)
    if not resume and group.is_main:
        import shutil

        shutil.rmtree(out.parent / f".{out.name}.lowbit-tmp", ignore_errors=True)
    output = StreamOutput(out, fmt, fp, len(layers), group, overwrite=overwrite)
    stream = LayerStream(skel, output, dev, offload, log=bool(progress))
    ok = False
    try:
        calib = LayerwiseCalibrator(model, scheme, cfg, smoothquant=sq, group=group)
        report = calib.run(local_batches(tokens, cfg.batch_size, group), names, progress=progress and group.is_main,
                           hooks=stream)
        report.num_samples = int(tokens.shape[0])
        summary = output.finish(model, path, ignore_list(model, names), tok, src, scheme)
        summary["unquantized_targets"] = [n for n, _ in left]
        ok = True
    finally:
        stream.close()
        if not ok:
            output.abort()
    return StreamResult(out, summary, report, stream.seconds, peak_rss_bytes(), group.world)
