"""The streamed calibrated run: skeleton, calibration tokens, the layer loop, the output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import QuantizationError


@dataclass(frozen=True)
class _Loop:
    """What the layer loop works with, once the run is set up."""

    group: object
    model: object
    output: object
    stream: object
    sq: object
    data: object
    path: str
    tok: object
    survey: object


def tokenizer_for(src: Path, calibration, tokenizer):
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


def streamed(plan):
    """The calibrated run of ``plan`` (a streamed ``lowbit.streamed.checkpoint_plan.CheckpointPlan``);
    its ``planned`` is closed when the run ends."""
    try:
        return _streamed(plan)
    finally:
        plan.planned.close()


def _streamed(plan):
    from lowbit.calibration import calibration_set
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.dist import Group
    from lowbit.files.outguard import check_not_source
    from lowbit.files.writer import check_output_free
    from lowbit.calibration.layer_survey import LayerSurvey
    from lowbit.model_quant import check_targets
    from lowbit.param_uses import ParamKind
    from lowbit.targets import survey_weights
    from lowbit.modelfree.device import resolve_device
    from lowbit.streamed.api import fingerprint
    from lowbit.streamed.output import StreamOutput
    from lowbit.streamed.planned import representative_alpha
    from lowbit.streamed.stream import LayerStream

    planned, out, cfg, ignore, run = plan.planned, plan.output, plan.config, plan.ignore, plan.settings
    skel, src = planned.skel, planned.skel.folder
    sq = plan.smoothquant()  # one alpha, or scheme -> alpha (mixed)
    dev = resolve_device(run.device)
    check_not_source(src, out)
    check_output_free(out, run.overwrite)
    group = run.group or Group.join(dev)
    from lowbit.calibration.reduce import check_distributable

    check_distributable(group, cfg, representative_alpha(sq))  # before any collective
    model = skel.model
    survey = survey_weights(model, ignore, False)
    deferred = frozenset() if survey.traced else frozenset(n for n, k in survey.kinds.items() if k is ParamKind.MATMUL)
    # structure alone cannot place them (the skeleton is on the meta device): each loaded layer's forward will
    survey.kinds = {n: k for n, k in survey.kinds.items() if n not in deferred}
    allow = plan.targets.allow_unquantized
    left = check_targets(model, ignore, False, allow, survey)
    layer_survey = LayerSurvey(deferred, allow, unquantized=[n for n, _ in left])
    tok = tokenizer_for(src, plan.calibration.data, plan.calibration.tokenizer)
    data = calibration_set(plan.calibration.data, tok, **cfg.data_options())
    tokens = data.ids
    names = planned.names
    found = find_decoder_layers(model, names)
    if found is None:
        raise QuantizationError(f"{src}: no decoder layers were found to stream; quantize it in memory "
                                f"(lowbit.quantize, then lowbit.save)")
    path, layers = found
    fp = fingerprint(plan, skel.ckpt, tokens, data.valid, group.world, dev)
    group.agree("the run's arguments (fingerprint)", fp)  # the recipe too: it is fingerprinted
    if not run.resume and group.is_main:
        import shutil

        from lowbit.files.staging import temporary_folder

        shutil.rmtree(temporary_folder(out), ignore_errors=True)
    output = StreamOutput(out, plan.checkpoint_format, fp, len(layers), group, overwrite=run.overwrite)  # refused: OutputError
    # a line per layer: asked for, or one per rank under torchrun (no terminal bar there)
    log = run.progress is True or (group.distributed and run.progress is not False)
    stream = LayerStream(skel, output, dev, run.offload, log=log)
    try:
        return _run(plan, _Loop(group, model, output, stream, sq, data, path, tok, layer_survey))
    except OSError as e:  # StreamOutput's writes raise OutputError already; any other write, the same line
        output.abort()
        from lowbit.errors import LowbitError
        from lowbit.files.refused import resumable_failure

        if isinstance(e, LowbitError):
            raise
        raise resumable_failure(e, out, "layers") from e
    except BaseException as e:
        # the temporary folder stays (the same command resumes), unless a refusal came first
        output.abort(refused=isinstance(e, QuantizationError))
        raise
    finally:
        stream.close()


def _run(plan, loop: _Loop):
    """The layer loop and the output's end; the StreamResult."""
    from lowbit.calibration import LayerwiseCalibrator
    from lowbit.streamed.api import StreamResult, peak_rss_bytes
    from lowbit.streamed.output import ignore_list

    planned, cfg, group, data = plan.planned, plan.config, loop.group, loop.data
    skel, names = planned.skel, planned.names
    calib = LayerwiseCalibrator(loop.model, planned.chosen, cfg, smoothquant=loop.sq, group=group,
                                survey=loop.survey)
    tokens = data.ids
    valid = None if data.valid is None else local_batches(data.valid, cfg.batch_size, group)
    report = calib.run(local_batches(tokens, cfg.batch_size, group), names, valid=valid,
                       progress=plan.settings.progress if group.is_main else False, hooks=loop.stream)
    report.num_samples = int(tokens.shape[0])
    report.data = data.info.as_dict()
    skel.materialize_outside(loop.path)  # released after the capture (LayerStream.captured)
    names = [n for n in names if n not in set(loop.survey.dropped)]
    summary = loop.output.finish(loop.model, loop.path, ignore_list(loop.model, names), loop.tok, skel.folder,
                                 planned.by_name())
    summary["unquantized_targets"] = list(loop.survey.unquantized)
    return StreamResult(plan.output, summary, report, loop.stream.seconds, peak_rss_bytes(), group.world)
