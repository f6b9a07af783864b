"""Model-free quantization split over torch.distributed ranks (torchrun, gloo on the CPU): the
output folder is byte for byte the one a single process writes (every file), fresh or resumed,
through the Python entry point and the CLI; a data error on one rank fails both and leaves
nothing; a killed rank ends the job and the same run resumes. Ranks that disagree are refused,
and the failure paths of each step are checked with a stand-in for the other rank (no torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

import lowbit
from helpers.modelfree import digests, mf, no_output
from helpers.models import tiny_llama
from lowbit.dist import DistError, Group
from lowbit.modelfree import RunOptions
from lowbit.modelfree.ranks import RankFailed, together

SRC_ROOT = Path(lowbit.__file__).resolve().parents[1]  # the lowbit under test, for the subprocesses
PARTS = 100_000  # source bytes per unit: every shard cut in parts, so ranks share shards








@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny Llama (hidden 128: whole w4a16 groups for compressed-tensors) saved by transformers
    in 6 shards, with a tokenizer file to copy."""
    d = tmp_path_factory.mktemp("src") / "tiny"
    tiny_llama(hidden_size=128, intermediate_size=256).save_pretrained(d, max_shard_size="300KB")
    assert len(list(d.glob("*.safetensors"))) == 6
    (d / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    return d


def torchrun(command: list[str], cwd: Path, timeout: float = 120, ok: bool = True) -> subprocess.CompletedProcess:
    """``command`` (an executable and its arguments) as 2 ranks of one torchrun job on this machine;
    ``ok``: it must succeed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SRC_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "--no-python", *command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert (r.returncode == 0) == ok, (r.returncode, r.stdout[-3000:], r.stderr[-5000:])
    return r


# each rank: an initialised gloo group, then the cases of argv[1]; the units each rank ran are
# written next to the output (on_event keeps the units in this process, in `workers` threads)
CASES_SCRIPT = r"""
import json, os, sys
import torch.distributed as dist
import lowbit
import lowbit.errors
from lowbit.modelfree import RunOptions
dist.init_process_group("gloo")
for case in json.load(open(sys.argv[1])):
    ran = []
    hook = lambda event, name, tensor: ran.append(name) if event == "shard" else None
    try:
        out = lowbit.quantize_checkpoint(case["src"], case["out"], scheme=case["scheme"], format=case["format"],
                                         workers=case["workers"], progress=False,
                                         run_options=RunOptions(part_bytes=case["part_bytes"], on_event=hook))
        assert str(out) == case["out"], out
    except lowbit.errors.LowbitError as e:
        ran = {"error": type(e).__name__ + ": " + str(e)}
    with open(case["out"] + f".rank{dist.get_rank()}.json", "w") as f:
        json.dump(ran, f)
dist.destroy_process_group()
"""


class _Stop(BaseException):
    """Stands for a run interrupted between two units of work."""


@pytest.fixture(scope="module")
def with_nan(tmp_path_factory) -> Path:
    """The same tiny Llama with a NaN in the last shard's up_proj."""
    import torch

    model = tiny_llama(hidden_size=128, intermediate_size=256)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    d = tmp_path_factory.mktemp("nan") / "tiny"
    model.save_pretrained(d, max_shard_size="300KB")
    return d


@pytest.mark.subprocess
def test_two_ranks_write_the_same_bytes_as_one_process_and_resume(sharded, with_nan, tmp_path):
    cases = [dict(scheme="w4a16", format="lowbit", part_bytes=128 << 20, workers=0),  # one unit a shard
             dict(scheme="w4a16", format="compressed-tensors", part_bytes=PARTS, workers=2),
             dict(scheme="nvfp4a16", format="compressed-tensors", part_bytes=PARTS, workers=0),
             dict(scheme="nvfp4-e5m3", format="lowbit", part_bytes=PARTS, workers=0, resume=True)]
    refs = []
    for k, case in enumerate(cases):
        case.update(src=str(sharded), out=str(tmp_path / f"dist-{k}"))
        opts = RunOptions(part_bytes=case["part_bytes"])
        refs.append(digests(mf(sharded, tmp_path / f"one-{k}", case["scheme"], format=case["format"],
                               run_options=opts)))
    # the resume case: one process stopped after 3 units, leaving them in the temporary folder
    stopped: list[str] = []

    def stop_after_three(event, name, tensor):
        if event == "shard":
            stopped.append(name)
            if len(stopped) == 3:
                raise _Stop()

    last = cases[-1]
    with pytest.raises(_Stop):
        mf(sharded, Path(last["out"]), last["scheme"], format=last["format"],
           run_options=RunOptions(part_bytes=PARTS, on_event=stop_after_three))
    assert (tmp_path / ".dist-3.lowbit-tmp").is_dir()
    bad = dict(scheme="w4a16", format="lowbit", part_bytes=PARTS, workers=0, src=str(with_nan),
               out=str(tmp_path / "nan"))  # one rank finds the NaN: both fail, nothing is left
    (tmp_path / "cases.json").write_text(json.dumps(cases + [bad]))

    torchrun([sys.executable, "-c", CASES_SCRIPT, str(tmp_path / "cases.json")], cwd=tmp_path)

    for k, (case, ref) in enumerate(zip(cases, refs)):
        out = Path(case["out"])
        assert digests(out) == ref, f"case {k}: {case['scheme']} {case['format']}"
        assert "tokenizer.json" in ref and "config.json" in ref
        ran = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
        assert ran[0] and ran[1] and not set(ran[0]) & set(ran[1]), f"case {k}: both ranks work, apart: {ran}"
        assert not list(tmp_path.glob(f".{out.name}.*"))  # no temporary folder, no lock left
        if case.get("resume"):
            assert not set(stopped) & (set(ran[0]) | set(ran[1]))  # the finished units were not redone
        elif case["part_bytes"] == PARTS:
            shards = {n.split(".part-")[0] for n in ran[0]} & {n.split(".part-")[0] for n in ran[1]}
            assert shards, f"case {k}: some shard is written by both ranks"
    errors = sorted(json.loads(Path(f"{bad['out']}.rank{r}.json").read_text())["error"] for r in (0, 1))
    assert errors[0].startswith("QuantizationError: ") and "up_proj.weight" in errors[0] and "NaN" in errors[0]
    assert errors[1].startswith("RankFailed: rank ") and "failed while quantizing" in errors[1], errors
    assert not list(tmp_path.glob("nan")) and not list(tmp_path.glob(".nan.*"))  # nothing half-written


KILL_SCRIPT = r"""
import os, signal, sys
import lowbit
from lowbit.modelfree import RunOptions
def hook(event, name, tensor):
    if event == "shard" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)  # rank 1 dies after its first unit
lowbit.quantize_checkpoint(sys.argv[1], sys.argv[2], scheme="w4a16", workers=0, progress=False,
                           run_options=RunOptions(part_bytes=int(sys.argv[3]), on_event=hook))
"""


@pytest.mark.subprocess
def test_a_killed_rank_ends_the_job_and_the_same_command_resumes(sharded, tmp_path):
    ref = digests(mf(sharded, tmp_path / "one", "w4a16", run_options=RunOptions(part_bytes=PARTS)))
    out = tmp_path / "out"
    # torchrun ends rank 0 too (or rank 0's next collective fails) and reports the failure
    torchrun([sys.executable, "-c", KILL_SCRIPT, str(sharded), str(out), str(PARTS)], cwd=tmp_path, ok=False)
    tmp = tmp_path / ".out.lowbit-tmp"
    finished = {p.name.removesuffix(".done.json") for p in (tmp / ".modelfree").glob("*.part-*.done.json")}
    assert not out.exists() and finished  # the finished units stay in the temporary folder
    redone: list[str] = []
    record = lambda e, n, t: redone.append(n) if e == "shard" else None  # noqa: E731
    mf(sharded, out, "w4a16", run_options=RunOptions(part_bytes=PARTS, on_event=record))  # the same run again
    assert redone and not set(redone) & finished  # only the unfinished units are redone
    assert digests(out) == ref


@pytest.mark.subprocess
def test_cli_under_torchrun_same_bytes_one_summary(sharded, tmp_path):
    ref = digests(mf(sharded, tmp_path / "one", "w4a16", format="compressed-tensors"))
    cli = [sys.executable, "-c", "from lowbit.cli import main; main()"]
    r = torchrun(cli + ["quantize", str(sharded), "--scheme", "w4a16", "--format", "compressed-tensors",
                        "--model-free", "-o", str(tmp_path / "two")], cwd=tmp_path)
    assert digests(tmp_path / "two") == ref
    text = " ".join(r.stdout.split())  # (rich wraps long lines)
    wrote = text.split(" serving, ")[0]  # the engines' verdicts follow the summary line
    assert text.count("wrote ") == 1 and wrote.endswith("on 2 ranks"), r.stdout  # rank 0 alone prints the summary


# ---------------------------------------------------------------------------- rank 1 stood in for
@dataclass(frozen=True)
class Peers(Group):
    """One rank of a 2-rank job with no process group: the other rank answers each gather with
    ``peer(this rank's object)`` and takes broadcasts as they are."""

    peer: Callable[[Any], Any] = lambda obj: obj

    def gather_objects(self, obj: Any) -> list[Any]:
        other = self.peer(obj)
        return [obj, other] if self.rank == 0 else [other, obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        pass


def peers(peer: Callable[[Any], Any]) -> Peers:
    return Peers(rank=0, world=2, distributed=True, peer=peer)


def test_ranks_that_disagree_on_an_argument_or_the_fingerprint_are_refused(sharded, tmp_path):
    other_resume = peers(lambda obj: {**obj, "resume": False} if isinstance(obj, dict) else obj)
    with pytest.raises(DistError, match=r"disagree on the argument 'resume': \[True, False\]"):
        mf(sharded, tmp_path / "out", "w4a16", group=other_resume)
    other_source = peers(lambda obj: "0" * 64 if isinstance(obj, str) else obj)  # the fingerprint
    with pytest.raises(DistError, match="disagree on the run's fingerprint"):
        mf(sharded, tmp_path / "out", "w4a16", group=other_source)
    assert no_output(tmp_path / "out")


def _fails_at(step: str, data: bool) -> Peers:
    def peer(obj):
        if isinstance(obj, tuple) and obj[0].startswith(step):
            return obj[0], ("QuantizationError: tensor model.layers.1.mlp.up_proj.weight holds NaN", data)
        return obj
    return peers(peer)


def test_a_data_error_on_another_rank_fails_rank_0_and_leaves_nothing(sharded, tmp_path):
    with pytest.raises(RankFailed, match="rank 1 of 2 failed while quantizing its share of the shards: "
                                         "QuantizationError: tensor model.layers.1"):
        mf(sharded, tmp_path / "out", "w4a16", group=_fails_at("quantizing", data=True))
    assert no_output(tmp_path / "out")  # the temporary folder and the lock are gone


def test_an_interrupted_rank_leaves_rank_0s_units_to_resume(sharded, tmp_path):
    ref = digests(mf(sharded, tmp_path / "one", "nvfp4a16", run_options=RunOptions(part_bytes=PARTS)))
    ran: list[str] = []
    record = lambda e, n, t: ran.append(n) if e == "shard" else None  # noqa: E731
    out = tmp_path / "out"
    with pytest.raises(RankFailed, match="rank 1 of 2 failed while quantizing"):
        mf(sharded, out, "nvfp4a16", group=_fails_at("quantizing", data=False),
           run_options=RunOptions(part_bytes=PARTS, on_event=record))
    assert ran and not out.exists() and (tmp_path / ".out.lowbit-tmp").is_dir()
    first, ran[:] = list(ran), []
    mf(sharded, out, "nvfp4a16", run_options=RunOptions(part_bytes=PARTS, on_event=record))  # one process resumes
    assert ran and not set(first) & set(ran)  # only rank 1's share is redone
    assert digests(out) == ref


def test_a_failure_on_rank_0_fails_every_rank():
    group = peers(lambda obj: obj)
    with pytest.raises(ValueError, match="bad"):
        with together(group, "a step"):
            raise ValueError("bad")
    rank1 = Peers(rank=1, world=2, distributed=True, peer=lambda obj: ("a step", ("ValueError: bad", False)))
    with pytest.raises(RankFailed, match="rank 0 of 2 failed while a step: ValueError: bad") as e:
        with together(rank1, "a step"):
            pass
    assert not e.value.data
    with pytest.raises(DistError, match="rank 1 is at step 'b' while rank 0 is at 'a'"):
        with together(peers(lambda obj: ("b", None)), "a"):
            pass


def test_balance_splits_every_item_once_by_size():
    sizes = [9, 7, 5, 5, 3, 2, 1, 1]
    shares = [Group(r, 3, True).balance(sizes) for r in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in s) for s in shares]
    assert max(totals) - min(totals) <= max(sizes) and shares[0][0] == 0
    assert Group.single().balance(sizes) == list(range(len(sizes)))
