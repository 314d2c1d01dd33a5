"""Checkpoints (issue 4, part 2) as runs write and resume them: what a checkpoint of a real fp16
run holds, and ``train --resume`` refusing files it must not trust.

Loading must use ``torch.load(weights_only=True)`` only: a pickle that would run code is refused
and its code never runs; truncated and foreign files are refused with exit 2 and one line. The
functions of ``ampguard.checkpoint`` alone are in ``tests/unit/test_checkpoint.py``.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from helpers import _truncated, ag, minimal_payload, one_error_line, read_rows

from ampguard import checkpoint as ckpt
from ampguard.checkpoint import MAGIC
from ampguard.errors import InputError


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    """fp16 linear, accumulation 2, 16 steps, a checkpoint every 4 keeping 2, an Inf gradient at step 12."""
    root = tmp_path_factory.mktemp("ckpt")
    code, out, err = ag("train", "--set", f"log.dir={root}", "--set", "log.name=run", "--set", "task.name=linear",
                        "--set", "precision=fp16", "--set", "steps=16", "--set", "accumulation_steps=2",
                        "--set", "checkpoint.every=4", "--set", "checkpoint.keep=2", "--set", "optimizer.name=adamw",
                        "--inject", "inf_grad@12")
    assert code == 0, out + err
    return root / "run"


# ---------------------------------------------------------------------------- what a checkpoint holds


def test_a_checkpoint_holds_everything_a_resume_needs(fp16_run):
    payload = ckpt.load_checkpoint(fp16_run / "checkpoints" / "step-00000012.pt")
    for key in ("magic", "format", "step", "updates", "config", "precision", "model", "optimizer", "scheduler",
                "state", "rng", "data_position"):
        assert key in payload, key
    assert payload["magic"] == MAGIC and payload["format"] == ckpt.FORMAT
    assert payload["step"] == 12 and payload["updates"] == 11  # step 12 was skipped
    assert payload["data_position"] == 24  # micro-batches: 12 steps of 2
    assert payload["precision"] == "fp16"
    assert payload["config"] == yaml.safe_load((fp16_run / "config.yaml").read_text(encoding="utf-8"))
    assert set(payload["model"]) == {"weight", "bias"}
    assert all(isinstance(v, torch.Tensor) for v in payload["model"].values())
    opt_state = payload["optimizer"]["state"]
    assert len(opt_state) == 2 and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in opt_state.values())
    assert payload["scheduler"]["last_epoch"] == 11  # the schedule held on the skipped step
    state = payload["state"]
    assert state["step"] == 12 and state["updates"] == 11 and state["accumulation_steps"] == 2
    assert state["precision"] == "fp16"
    assert state["monitors"]["run"]["steps"] == 12 and state["monitors"]["run"]["skips"] == {"non_finite_grad": 1}
    rng = payload["rng"]
    assert {"torch", "random", "numpy"} <= set(rng)
    assert ("cuda" in rng) == torch.cuda.is_available()


def test_the_saved_scaler_is_taken_after_update(fp16_run):
    """Step 12 overflowed: the scale halved in that step's update(); the checkpoint has the halved one."""
    scales = {int(r["step"]): float(r["scaler_scale"]) for r in read_rows(fp16_run / "steps.csv")}
    assert scales[12] == scales[11] / 2
    scaler = ckpt.load_checkpoint(fp16_run / "checkpoints" / "step-00000012.pt")["state"]["scaler"]
    assert scaler["scale"] == scales[12]
    assert scaler["_growth_tracker"] == 0  # reset by the backoff
    assert ckpt.load_checkpoint(fp16_run / "checkpoints" / "step-00000016.pt")["state"]["scaler"]["scale"] == scales[16]


def test_a_run_keeps_its_last_checkpoint_keep_checkpoints(fp16_run):
    folder = fp16_run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000012.pt", "step-00000016.pt"]  # no temp files

# ---------------------------------------------------------------------------- safe load


class RunsCode:
    """Unpickling this calls ``func(*args)``: code in a checkpoint."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _evil_objects(marker: Path) -> dict[str, object]:
    return {
        "os.system": RunsCode(os.system, (f"echo pwned > {marker}",)),
        "open": RunsCode(open, (str(marker), "w")),
    }


def _write_evil(path: Path, how: str, obj: object) -> None:
    """A file that looks like an ampguard checkpoint but carries ``obj`` inside."""
    payload = {"magic": MAGIC, "format": ckpt.FORMAT, **minimal_payload(4), "model": {"w": obj}}
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("how", ["torch.save", "pickle"])
@pytest.mark.parametrize("kind", ["os.system", "open"])
def test_a_pickle_that_runs_code_is_refused_and_its_code_never_runs(tmp_path, snapshot, how, kind):
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "steps.csv").write_text("step\n", encoding="utf-8")
    evil = run / "checkpoints" / "step-00000004.pt"
    _write_evil(evil, how, _evil_objects(marker)[kind])
    before = snapshot(run)

    with pytest.raises(InputError, match="refused"):
        ckpt.load_checkpoint(evil)
    assert not marker.exists()
    line = one_error_line(ag("train", "--resume", evil))
    assert str(evil) in line
    assert not marker.exists()
    line = one_error_line(ag("train", "--resume", run))  # the folder form: its only checkpoint is refused
    assert "no loadable checkpoint" in line
    assert not marker.exists()
    assert snapshot(run) == before

    # the file really does carry code: a plain unpickling runs it (this is what weights_only prevents)
    if how == "torch.save":
        torch.load(evil, weights_only=False)
    else:
        with open(evil, "rb") as f:
            pickle.load(f)
    assert marker.exists()


@pytest.fixture
def real_checkpoint(fp16_run, tmp_path) -> Path:
    """A copy of the fp16 run to spoil."""
    run = tmp_path / "run"
    shutil.copytree(fp16_run, run)
    return run


BAD_FILES = {
    "truncated": lambda p: _truncated(p),
    "empty": lambda p: p.write_bytes(b""),
    "zeros": lambda p: p.write_bytes(bytes(4096)),  # what a crash can leave of a file not yet synced
    "garbage": lambda p: p.write_bytes(b"\xff" * 64),
    "foreign dict": lambda p: torch.save({"state_dict": {"w": torch.ones(2)}, "epoch": 3}, p),
    "foreign tensor": lambda p: torch.save(torch.ones(3), p),
    "no marker": lambda p: torch.save(minimal_payload(12), p),
    "incomplete": lambda p: torch.save({"magic": MAGIC, "format": ckpt.FORMAT, "step": 12}, p),
    "other format": lambda p: torch.save({"magic": MAGIC, **minimal_payload(12), "format": ckpt.FORMAT + 1}, p),
}


@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_a_file_that_is_not_a_whole_ampguard_checkpoint_is_refused(real_checkpoint, snapshot, bad):
    path = real_checkpoint / "checkpoints" / "step-00000016.pt"
    BAD_FILES[bad](path)
    with pytest.raises(InputError):
        ckpt.load_checkpoint(path)
    before = snapshot(real_checkpoint)
    line = one_error_line(ag("train", "--resume", path, "--set", "steps=20"))
    assert str(path) in line
    assert snapshot(real_checkpoint) == before


@pytest.mark.parametrize("content", [b"junk", b"this is not a checkpoint\n"])
def test_a_small_non_pytorch_file_is_refused_with_one_line(real_checkpoint, content):
    folder = real_checkpoint / "checkpoints"
    path = folder / "step-00000020.pt"  # the newest "checkpoint" of the run
    path.write_bytes(content)
    newest_good, _ = ckpt.latest_loadable(folder)
    assert newest_good.name == "step-00000016.pt"
    with pytest.raises(InputError):
        ckpt.load_checkpoint(path)
    line = one_error_line(ag("train", "--resume", path, "--set", "steps=24"))
    assert str(path) in line


def test_resume_of_a_missing_checkpoint_is_refused(tmp_path):
    line = one_error_line(ag("train", "--resume", tmp_path / "nowhere" / "step-00000001.pt"))
    assert "nowhere" in line
    line = one_error_line(ag("train", "--resume", tmp_path))  # a folder with no checkpoints
    assert "no checkpoint" in line
