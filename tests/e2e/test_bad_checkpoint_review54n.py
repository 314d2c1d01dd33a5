"""Review 54n (fuzzing the bad-input rule): checkpoints whose fields the fuzzer swapped for a
tensor, a list or a string, and run folders whose logs are folders. Each is bad input: one
``ampguard: error:`` line, exit 2, nothing written; a run folder's newest checkpoint that does not
read is set aside and the older one resumed, as after a torn write.

The fuzzer's minimal inputs: a real 4-step linear run, its newest checkpoint edited by one field.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import ag, deadline, ok, one_error_line, train

from ampguard import checkpoint as ckpt

LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "log.plot=false"]
CKPT2, CKPT4 = "step-00000002.pt", "step-00000004.pt"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished 4-step linear run with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("r54n")
    ok(train(root, "lin", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=10",
             "--set", "log.every=1000"))
    return root / "lin"


def spoiled(base: Path, tmp_path: Path, edit) -> Path:
    """A copy of the run whose step-4 checkpoint's payload went through ``edit``; its run folder."""
    run = tmp_path / "lin"
    shutil.copytree(base, run)
    path = run / "checkpoints" / CKPT4
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)  # (as the fuzzer did: torch.save, the checksums dropped with the marker)
    return run


def refused(snapshot, run: Path, *argv: object) -> str:
    """``ampguard ARGV``: one error line, exit 2, and not a byte of ``run`` changed."""
    before = snapshot(run)
    with deadline(120):
        line = one_error_line(ag(*argv))
    assert snapshot(run) == before
    return line


def verbs(run: Path, tmp_path: Path) -> dict[str, list[object]]:
    path = run / "checkpoints" / CKPT4
    return {"resume": ["train", "--resume", path, "--set", "steps=6"],
            "locate": ["locate", *LINEAR, "--checkpoint", path],
            "validate": ["validate", *LINEAR, "--set", "validation.precisions=[bf16]", "--checkpoint", path,
                         "--out", tmp_path / "v"]}


# ---------------------------------------------------------------------------- F1: format (or magic) a tensor


@pytest.mark.parametrize("verb", ["resume", "locate", "validate"])
def test_a_checkpoint_whose_format_is_a_tensor_is_one_line_for_every_verb(base, tmp_path, snapshot, monkeypatch,
                                                                          verb):
    """It was ``RuntimeError: Boolean value of Tensor with more than one value is ambiguous``, a traceback."""
    monkeypatch.chdir(tmp_path)
    run = spoiled(base, tmp_path, lambda p: p.__setitem__("format", torch.tensor([1, 2])))
    line = refused(snapshot, run, *verbs(run, tmp_path)[verb])
    assert f"{run / 'checkpoints' / CKPT4}: checkpoint format a Tensor, this ampguard reads 1" in line
    assert not (tmp_path / "v").exists()


def test_a_run_folders_newest_checkpoint_whose_format_is_a_tensor_is_set_aside_for_the_older_one(base, tmp_path):
    """The exception was no InputError, so the resume died instead of passing it over."""
    run = spoiled(base, tmp_path, lambda p: p.__setitem__("format", torch.tensor([1, 2])))
    with deadline(120):
        out = ok(ag("train", "--resume", run, "--set", "steps=6"))
    assert "resuming from step-00000002.pt" in out
    assert "newer checkpoints set aside: step-00000004.pt (checkpoint format a Tensor, this ampguard reads 1)" in out


# ---------------------------------------------------------------------------- F2: a weight that is no tensor


@pytest.mark.parametrize("verb", ["resume", "locate", "validate"])
@pytest.mark.parametrize("value, said", [("list", "a list of 4"), ("str", "'w'")])  # (linear's weight: 4 rows)
def test_a_weight_that_is_not_a_tensor_is_named(base, tmp_path, snapshot, monkeypatch, verb, value, said):
    """locate/validate said ``does not fit this model (Error(s) in loading state_dict for Linear:)``,
    resume ``model is a OrderedDict, expected a mapping``: neither named the entry."""
    monkeypatch.chdir(tmp_path)

    def edit(payload):
        weight = payload["model"]["weight"]
        assert len(weight) == 4
        payload["model"]["weight"] = weight.tolist() if value == "list" else "w"

    run = spoiled(base, tmp_path, edit)
    line = refused(snapshot, run, *verbs(run, tmp_path)[verb])
    assert line.endswith(f"{run / 'checkpoints' / CKPT4}: bad checkpoint: model.weight is {said}, expected a tensor")


# ---------------------------------------------------------------------------- F3: validate and locate check the step


@pytest.mark.parametrize("verb", ["locate", "validate"])
@pytest.mark.parametrize("step, said", [("abc", "'abc'"), (True, "True"), (None, "None"), (-1, "-1")])
def test_validate_and_locate_refuse_a_step_resume_refuses(base, tmp_path, snapshot, monkeypatch, verb, step, said):
    """validate wrote ``Weights: from CKPT (step abc)`` into its report; locate dropped its stale-weights warning."""
    monkeypatch.chdir(tmp_path)
    run = spoiled(base, tmp_path, lambda p: p.__setitem__("step", step))
    line = refused(snapshot, run, *verbs(run, tmp_path)[verb])
    assert line.endswith(f"{run / 'checkpoints' / CKPT4}: bad checkpoint: step is {said}, expected an int >= 0")
    assert not (tmp_path / "v").exists()


# ---------------------------------------------------------------------------- F4: the embedded config's schema


@pytest.mark.parametrize("form", ["folder", "file"])
@pytest.mark.parametrize("key, value, said", [
    ("optimizer.lr", 10**40, "config: optimizer.lr: "),  # (past float32; the fuzzer's 1e30 is a setting the schema takes)
    ("scheduler_on_skip", -5, "config: scheduler_on_skip: "),
    ("log.dir", {"a": 1}, "config: log.dir: "),
])
def test_a_checkpoint_whose_config_the_schema_refuses_is_a_bad_checkpoint_not_a_policy_change(
        base, tmp_path, snapshot, form, key, value, said):
    """It resumed, and wrote ``POLICY 3 scheduler_on_skip -5 -> 'hold'`` to the console, events.jsonl
    and the card: a setting the run could never have had. Refused as any other bad field is (a run folder's too:
    it reads, so it is not passed over for an older one)."""
    def edit(payload):
        section, _, name = key.rpartition(".")
        (payload["config"][section] if section else payload["config"])[name] = value

    run = spoiled(base, tmp_path, edit)
    line = refused(snapshot, run, "train", "--resume", run if form == "folder" else run / "checkpoints" / CKPT4,
                   "--set", "steps=6")
    assert f"{run / 'checkpoints' / CKPT4}: bad checkpoint: {said}" in line


def test_a_checkpoint_config_the_schema_takes_still_resumes(base, tmp_path):
    """The run's own checkpoint (its config as the run wrote it) goes on."""
    run = tmp_path / "lin"
    shutil.copytree(base, run)
    with deadline(120):
        out = ok(ag("train", "--resume", run, "--set", "steps=6"))
    assert "resuming from step-00000004.pt" in out and "POLICY" in out  # (steps 4 -> 6)
    assert ckpt.load_checkpoint(run / "checkpoints" / "step-00000006.pt")["step"] == 6


# ---------------------------------------------------------------------------- F5: report's logs as folders


@pytest.mark.parametrize("name", ["steps.csv", "events.jsonl"])
def test_report_says_a_log_that_is_a_folder_is_one(base, tmp_path, snapshot, name):
    """It said ``no per-step CSV at RUN/steps.csv`` (it exists) and ``not a regular file (a pipe, a device)``."""
    run = tmp_path / "lin"
    shutil.copytree(base, run)
    (run / name).unlink()
    (run / name).mkdir()
    line = refused(snapshot, run, "report", run, "--no-plot")
    assert f"{run / name}" in line and "is a folder, not a file" in line, line
