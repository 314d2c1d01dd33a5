"""The checkpoint manager (``ampguard.checkpointer``): a registry of stateful parts saved as one payload.

Most tests drive it with fakes (plain objects with ``state_dict`` / ``load_state_dict``): no model,
no training loop. ``ModelState`` / ``OptimizerState`` / ``RngState`` get a tiny real model.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ampguard import checkpoint as ckpt
from ampguard import checkpointer as ck
from ampguard.checkpointer import (
    CONFIG, DATA, MODEL, OPTIMIZER, PRECISION, RESUME_FIXED, RNG, ROLLBACKS, SCHEDULER, STATE, STEP,
    TORCH_VERSION, UPDATES, WORLD_SIZE, CheckpointManager, Loaded, ModelState, OptimizerState, Resume, RngState,
)
from ampguard.config import validate
from ampguard.distributed import DistInfo
from ampguard.errors import InputError
from ampguard.monitor import LossSpikeDetector


class Fake:
    """A stateful part: its state is ``value``; it logs every load into ``journal`` as (name, state)."""

    def __init__(self, name: str, value: Any, journal: list[tuple[str, Any]] | None = None) -> None:
        self.name, self.value = name, value
        self.journal = journal if journal is not None else []

    def state_dict(self) -> Any:
        return {"value": self.value}

    def load_state_dict(self, state: Any) -> None:
        self.value = state["value"]
        self.journal.append((self.name, state["value"]))


class Raises(Fake):
    """A part whose load fails the way a mismatched ``load_state_dict`` does."""

    def __init__(self, error: Exception) -> None:
        super().__init__("raises", 0)
        self.error = error

    def load_state_dict(self, state: Any) -> None:
        raise self.error


ORDER = (MODEL, OPTIMIZER, SCHEDULER, STATE, RNG, DATA)


class Run:
    """A manager over one fake per payload part, with a ``meta`` that follows ``self.step``."""

    def __init__(self, folder: Path | None, keep: int = 10, dist: DistInfo | None = None) -> None:
        self.journal: list[tuple[str, Any]] = []
        self.parts = {name: Fake(name, f"{name}@0", self.journal) for name in ORDER}
        self.step = 0
        self.manager = CheckpointManager(folder, self.parts, keep=keep, meta=self.meta, dist=dist)

    def meta(self) -> dict[str, Any]:
        return {STEP: self.step, UPDATES: self.step - 1, CONFIG: {"seed": 0}, PRECISION: "bf16",
                WORLD_SIZE: 1, TORCH_VERSION: "x"}

    def set(self, step: int) -> None:
        """Every part's value becomes ``<name>@<step>``."""
        self.step = step
        for name, part in self.parts.items():
            part.value = f"{name}@{step}"

    def save(self, step: int) -> Path | None:
        self.set(step)
        return self.manager.save(step)

    def values(self) -> dict[str, Any]:
        return {name: part.value for name, part in self.parts.items()}


def steps_of(paths: list[Path]) -> list[int]:
    return [ckpt.checkpoint_step(p) for p in paths]


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------------------- save


def test_save_writes_the_step_file_with_every_part_and_the_meta_under_the_payload_keys(tmp_path):
    run = Run(tmp_path / "ck")
    path = run.save(7)
    assert path == tmp_path / "ck" / "step-00000007.pt" and path.is_file()
    payload = ckpt.load_checkpoint(path)  # loadable by the low-level loader: every REQUIRED key is there
    for name in ORDER:
        assert payload[name] == {"value": f"{name}@7"}, name
    assert payload[STEP] == 7 and payload[UPDATES] == 6 and payload[CONFIG] == {"seed": 0}
    assert payload[PRECISION] == "bf16" and payload[WORLD_SIZE] == 1 and payload[TORCH_VERSION] == "x"
    assert payload["magic"] == ckpt.MAGIC and payload["format"] == ckpt.FORMAT
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step-00000007.pt"]  # no temporary file left


def test_save_reads_the_parts_and_meta_at_each_save_not_at_construction(tmp_path):
    run = Run(tmp_path)
    run.save(1)
    run.save(2)
    first, second = (ckpt.load_checkpoint(p) for p in run.manager.saved)
    assert first[STEP] == 1 and first[MODEL] == {"value": "model@1"}
    assert second[STEP] == 2 and second[MODEL] == {"value": "model@2"}


def test_a_part_overrides_a_meta_entry_of_the_same_key(tmp_path):
    run = Run(tmp_path)
    run.manager.meta = lambda: {**run.meta(), MODEL: "from meta"}
    payload = ckpt.load_checkpoint(run.save(3))
    assert payload[MODEL] == {"value": "model@3"}


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_prunes_to_the_newest_and_saved_lists_them_oldest_first(tmp_path, keep):
    run = Run(tmp_path, keep=keep)
    for step in (2, 4, 6, 8, 10):
        run.save(step)
        assert steps_of(run.manager.saved) == steps_of(ckpt.list_checkpoints(tmp_path))  # saved is the folder
    assert steps_of(run.manager.saved) == [2, 4, 6, 8, 10][-keep:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in run.manager.saved]


def test_a_new_manager_lists_the_checkpoints_already_in_its_folder(tmp_path):
    Run(tmp_path).save(3)
    Run(tmp_path).save(5)
    assert steps_of(Run(tmp_path).manager.saved) == [3, 5]
    assert Run(tmp_path / "missing").manager.saved == []


def test_only_rank_0_writes(tmp_path):
    Run(tmp_path).save(1)
    other = Run(tmp_path, dist=DistInfo(rank=1, world_size=2))
    assert other.manager.saved == []  # other ranks do not list rank 0's folder
    assert other.save(2) is None
    assert steps_of(ckpt.list_checkpoints(tmp_path)) == [1]


def test_checkpoints_off_save_returns_none_and_load_is_bad_input(tmp_path):
    run = Run(None)
    assert run.manager.enabled is False
    assert run.save(4) is None
    assert run.manager.saved == [] and run.manager.set_aside_after(0) == []
    with pytest.raises(InputError) as err:
        run.manager.load()
    assert "off" in one_line(err)
    with pytest.raises(InputError):
        run.manager.load(before_step=10)


# ---------------------------------------------------------------------------- load


def test_load_returns_the_newest_checkpoint(tmp_path):
    run = Run(tmp_path)
    for step in (1, 2, 3):
        run.save(step)
    loaded = run.manager.load()
    assert isinstance(loaded, Loaded)
    assert loaded.path.name == "step-00000003.pt" and loaded.step == 3
    assert loaded.payload[MODEL] == {"value": "model@3"}


@pytest.mark.parametrize("junk", [b"", b"\x00" * 10, b"not a checkpoint at all", "half"])
def test_load_falls_back_to_an_older_checkpoint_when_the_newest_does_not_load(tmp_path, junk):
    run = Run(tmp_path)
    for step in (1, 2, 3):
        run.save(step)
    newest = tmp_path / "step-00000003.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2] if junk == "half" else junk)
    loaded = run.manager.load()
    assert loaded.step == 2 and loaded.path.name == "step-00000002.pt"
    assert loaded.payload[OPTIMIZER] == {"value": "optimizer@2"}


def test_load_with_no_loadable_checkpoint_is_one_line_of_bad_input(tmp_path):
    run = Run(tmp_path)
    with pytest.raises(InputError) as err:
        run.manager.load()
    assert "no checkpoint" in one_line(err)
    run.save(1)
    (tmp_path / "step-00000001.pt").write_bytes(b"junk")
    with pytest.raises(InputError) as err:
        run.manager.load()
    assert "no loadable checkpoint" in one_line(err) and "step-00000001.pt" in str(err.value)


@pytest.mark.parametrize(("before", "expected"), [(7, 6), (6, 4), (5, 4), (3, 2), (100, 6)])
def test_load_before_step_takes_the_newest_strictly_before(tmp_path, before, expected):
    run = Run(tmp_path)
    for step in (2, 4, 6):
        run.save(step)
    loaded = run.manager.load(before_step=before)
    assert loaded.step == expected and loaded.path.name == ckpt.checkpoint_name(expected)
    assert loaded.payload[MODEL] == {"value": f"model@{expected}"}


@pytest.mark.parametrize("before", [2, 1, 0])
def test_load_before_step_with_none_that_early_is_one_line_of_bad_input(tmp_path, before):
    run = Run(tmp_path)
    for step in (2, 4, 6):
        run.save(step)
    with pytest.raises(InputError) as err:
        run.manager.load(before_step=before)
    assert f"before step {before}" in one_line(err)


def test_load_before_step_skips_a_broken_one_and_never_goes_past_the_bound(tmp_path):
    run = Run(tmp_path)
    for step in (2, 4, 6):
        run.save(step)
    (tmp_path / "step-00000004.pt").write_bytes(b"torn")
    assert run.manager.load(before_step=6).step == 2
    (tmp_path / "step-00000002.pt").write_bytes(b"torn")
    with pytest.raises(InputError) as err:
        run.manager.load(before_step=6)  # step 6 loads, but it is not before step 6
    one_line(err)


# ---------------------------------------------------------------------------- restore


def test_restore_loads_every_registered_part_in_registry_order(tmp_path):
    run = Run(tmp_path)
    run.save(5)
    run.set(9)
    run.journal.clear()
    run.manager.restore(run.manager.load())
    assert run.values() == {name: f"{name}@5" for name in ORDER}
    assert [name for name, _ in run.journal] == list(ORDER)


def test_restore_parts_restores_only_the_named_parts(tmp_path):
    run = Run(tmp_path)
    run.save(5)
    run.set(9)
    run.journal.clear()
    run.manager.restore(run.manager.load(), parts=[MODEL, RNG])
    assert run.values() == {MODEL: "model@5", OPTIMIZER: "optimizer@9", SCHEDULER: "scheduler@9",
                            STATE: "state@9", RNG: "rng@5", DATA: "data_position@9"}
    assert run.journal == [(MODEL, "model@5"), (RNG, "rng@5")]
    run.manager.restore(run.manager.load(), parts=[])
    assert len(run.journal) == 2


def test_restore_parts_named_out_of_order_still_load_in_registry_order(tmp_path):
    run = Run(tmp_path)
    run.save(5)
    run.journal.clear()
    run.manager.restore(run.manager.load(), parts=[RNG, OPTIMIZER, MODEL])
    assert [name for name, _ in run.journal] == [MODEL, OPTIMIZER, RNG]


@pytest.mark.parametrize("error", [
    ValueError("window of 8 steps, this monitor has 4\nsecond line"),
    KeyError("scaler"),
    TypeError("expected a dict"),
    RuntimeError("Error(s) in loading state_dict for Linear:\n\tsize mismatch for weight"),
])
def test_a_part_that_does_not_fit_is_one_line_naming_the_file(tmp_path, error):
    run = Run(tmp_path)
    path = run.save(3)
    run.manager.parts[STATE] = Raises(error)
    with pytest.raises(InputError) as err:
        run.manager.restore(run.manager.load())
    line = one_line(err)
    assert line.startswith(f"{path}: does not fit this run")
    first = str(error).splitlines()[0]
    assert first in line and "second line" not in line and "size mismatch" not in line
    assert err.value.__cause__ is None and err.value.__suppress_context__  # "from None": no chained traceback


def test_a_checkpoint_missing_a_registered_part_does_not_fit(tmp_path):
    run = Run(tmp_path)
    path = run.save(3)
    run.manager.parts[ROLLBACKS] = Fake(ROLLBACKS, [])  # registered after the checkpoint was written
    with pytest.raises(InputError) as err:
        run.manager.restore(run.manager.load())
    assert one_line(err).startswith(f"{path}: does not fit this run") and ROLLBACKS in str(err.value)


def test_a_model_of_another_shape_does_not_fit(tmp_path):
    model = nn.Linear(3, 2)
    CheckpointManager(tmp_path, {MODEL: ModelState(model)}, keep=1, meta=lambda: _meta(1)).save(1)
    manager = CheckpointManager(tmp_path, {MODEL: ModelState(nn.Linear(4, 2))}, keep=1)
    with pytest.raises(InputError) as err:
        manager.restore(manager.load())
    assert "does not fit this run" in one_line(err) and "step-00000001.pt" in str(err.value)


# ---------------------------------------------------------------------------- set aside


def test_set_aside_after_moves_newer_checkpoints_into_an_abandoned_folder(tmp_path):
    run = Run(tmp_path)
    for step in (2, 4, 6, 8):
        run.save(step)
    moved = run.manager.set_aside_after(4)
    assert steps_of(moved) == [6, 8]
    assert steps_of(run.manager.saved) == [2, 4] == steps_of(ckpt.list_checkpoints(tmp_path))
    abandoned = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert len(abandoned) == 1 and abandoned[0].name.startswith("abandoned-")
    assert sorted(p.name for p in abandoned[0].iterdir()) == ["step-00000006.pt", "step-00000008.pt"]
    assert ckpt.load_checkpoint(abandoned[0] / "step-00000008.pt")[STEP] == 8  # kept whole, not deleted
    assert run.manager.load().step == 4  # a later load does not pick them
    assert Run(tmp_path).manager.load().step == 4
    assert steps_of(Run(tmp_path).manager.saved) == [2, 4]


def test_set_aside_after_the_newest_moves_nothing_and_makes_no_folder(tmp_path):
    run = Run(tmp_path)
    for step in (2, 4):
        run.save(step)
    assert run.manager.set_aside_after(4) == [] and run.manager.set_aside_after(10) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002.pt", "step-00000004.pt"]


def test_set_aside_after_on_another_rank_moves_nothing(tmp_path):
    run = Run(tmp_path)
    for step in (2, 4):
        run.save(step)
    assert Run(tmp_path, dist=DistInfo(rank=1, world_size=2)).manager.set_aside_after(0) == []
    assert steps_of(ckpt.list_checkpoints(tmp_path)) == [2, 4]


def test_after_a_set_aside_the_same_steps_are_saved_again_and_pruned_normally(tmp_path):
    run = Run(tmp_path, keep=2)
    for step in (2, 4, 6):
        run.save(step)
    run.manager.set_aside_after(4)
    run.save(6)
    run.save(8)
    assert steps_of(run.manager.saved) == [6, 8]
    assert run.manager.load().payload[MODEL] == {"value": "model@8"}


# ---------------------------------------------------------------------------- resume


def _meta(step: int, config: dict | None = None, world_size: int | None = 1) -> dict[str, Any]:
    """A payload ``check_payload`` accepts (the guarded step's state with every key it writes)."""
    state = {"scaler": {}, "step": step, "updates": step, "precision": "bf16", "accumulation_steps": 1,
             "monitors": {}}
    meta = {STEP: step, CONFIG: config if config is not None else {}, MODEL: {},
            OPTIMIZER: {"state": {}, "param_groups": []}, SCHEDULER: {}, STATE: state, RNG: {}, DATA: step}
    if world_size is not None:
        meta[WORLD_SIZE] = world_size
    return meta


def _run_folder(root: Path, steps: tuple[int, ...] = (2, 4), csv: bool = True) -> Path:
    for step in steps:
        ckpt.save_checkpoint(root / "checkpoints" / ckpt.checkpoint_name(step), _meta(step))
    (root / "checkpoints").mkdir(parents=True, exist_ok=True)
    if csv:
        (root / "steps.csv").write_text("step\n1\n", encoding="utf-8")
    return root


def test_find_resume_of_a_run_folder_takes_its_newest_loadable_checkpoint(tmp_path):
    run = _run_folder(tmp_path / "run", (2, 4, 6))
    (run / "checkpoints" / "step-00000006.pt").write_bytes(b"torn")
    resume = ck.find_resume(run)
    assert resume.run_dir == run and resume.path == run / "checkpoints" / "step-00000004.pt"
    assert resume.loaded.step == 4 and resume.saved_config == {}


def test_find_resume_of_a_file_inside_checkpoints_belongs_to_that_run_folder(tmp_path):
    run = _run_folder(tmp_path / "run", (2, 4))
    resume = ck.find_resume(str(run / "checkpoints" / "step-00000002.pt"))  # a str works too
    assert resume.run_dir == run and resume.loaded.step == 2
    assert resume.path == run / "checkpoints" / "step-00000002.pt"


def test_find_resume_of_a_file_elsewhere_takes_the_folder_it_is_in(tmp_path):
    ckpt.save_checkpoint(tmp_path / "loose" / "step-00000003.pt", _meta(3))
    (tmp_path / "loose" / "steps.csv").write_text("step\n", encoding="utf-8")
    assert ck.find_resume(tmp_path / "loose" / "step-00000003.pt").run_dir == tmp_path / "loose"


def test_find_resume_refuses_a_folder_without_steps_csv(tmp_path):
    run = _run_folder(tmp_path / "run", (2,), csv=False)
    for target in (run, run / "checkpoints" / "step-00000002.pt"):
        with pytest.raises(InputError) as err:
            ck.find_resume(target)
        assert "steps.csv" in one_line(err) and str(run) in str(err.value)


def test_find_resume_refuses_a_run_without_checkpoints_and_a_torn_file(tmp_path):
    run = _run_folder(tmp_path / "run", ())
    with pytest.raises(InputError) as err:
        ck.find_resume(run)
    assert "no checkpoint" in one_line(err)
    bad = run / "checkpoints" / "step-00000009.pt"
    bad.write_bytes(b"torn")
    with pytest.raises(InputError) as err:
        ck.find_resume(bad)
    assert str(bad) in one_line(err)
    with pytest.raises(InputError):
        ck.find_resume(run / "checkpoints" / "step-00000010.pt")  # no such file


BASE = {"precision": "bf16", "accumulation_steps": 2, "seed": 3, "steps": 20,
        "task": {"name": "charlm", "n_embd": 16, "n_head": 2}, "optimizer": {"name": "adamw"}}


def _resume(step: int = 8, world_size: int | None = 1, **changes: Any) -> Resume:
    config = validate({**BASE, **changes}).model_dump(mode="json")
    return Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(step, config, world_size)), Path("run"))


def _with(**changes: Any) -> Any:
    return validate({**BASE, **changes})


FIXED_CHANGES = [
    ({"precision": "fp16"}, "precision", "'bf16'", "'fp16'"),
    ({"accumulation_steps": 4}, "accumulation_steps", "2", "4"),
    ({"seed": 4}, "seed", "3", "4"),
    ({"task": {"name": "charlm", "n_embd": 32, "n_head": 2}}, "task.n_embd", "16", "32"),
    ({"task": {"name": "charlm", "n_embd": 16, "n_head": 4}}, "task.n_head", "2", "4"),
    ({"task": {"name": "linear", "n_embd": 16, "n_head": 2}}, "task.name", "'charlm'", "'linear'"),
    ({"task": {"name": "charlm", "n_embd": 16, "n_head": 2, "factory": "m:build"}}, "task.factory", "null", "'m:build'"),  # (YAML: review 53a)
    ({"optimizer": {"name": "sgd"}}, "optimizer.name", "'adamw'", "'sgd'"),
    ({"optimizer": {"name": "adamw", "fused": False}}, "optimizer.fused", "null", "false"),
    ({"monitor": {"window": 7}}, "monitor.window", "1000", "7"),
]


@pytest.mark.parametrize(("change", "field", "was", "now"), FIXED_CHANGES)
def test_check_resume_refuses_a_fixed_key_change_naming_the_exact_field(change, field, was, now):
    with pytest.raises(InputError) as err:
        ck.check_resume(_resume(), _with(**change), world_size=1)
    line = one_line(err)
    assert line == f"--resume: {field} was {was} in the checkpoint, now {now}; a resumed run must keep it"


GPT2_SIZES = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
SAME_TASK = [  # review 53i: settings the task never reads, and a preset against its own sizes spelled out
    ({"name": "digits"}, {"name": "digits", "n_head": 8}),
    ({"name": "digits"}, {"name": "digits", "block_size": 32, "n_layer": 3}),
    ({"name": "linear"}, {"name": "linear", "n_embd": 32}),
    ({"name": "linear", "options": {"w": 1}}, {"name": "linear"}),
    ({"preset": "gpt2-small"}, GPT2_SIZES),
    (GPT2_SIZES, {"preset": "gpt2-small"}),
]


def _task_resume(task: dict[str, Any]) -> Resume:
    config = validate({**BASE, "task": task}).model_dump(mode="json")
    return Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, config)), Path("run"))


@pytest.mark.parametrize(("saved", "now"), SAME_TASK)
def test_check_resume_keeps_only_the_task_settings_the_task_reads(saved, now):
    # review 53i: a digits run resumed with another n_head (which digits never reads) was refused,
    # and gpt2-small against the same sizes spelled out, though nothing changes either way
    ck.check_resume(_task_resume(saved), _with(task=now), world_size=1)


@pytest.mark.parametrize(("saved", "now"), SAME_TASK)
def test_a_task_setting_the_task_does_not_read_is_no_policy_change(saved, now):
    # review 53j: accepted on resume, it was a POLICY line and a card row ("task.n_layer 2 -> 3"),
    # and a finished run's card rewrite was refused as "task.preset would apply to no step"
    resume = _task_resume(saved)  # (at step 8 of 20)
    assert ck.policy_changes(resume, _with(task=now)) == []
    assert [c["key"] for c in ck.policy_changes(resume, _with(task=now, steps=30))] == ["steps"]
    ck.check_left_to_train(resume, _with(task=now, steps=8))  # (ended at its checkpoint: the card rewritten)


@pytest.mark.parametrize(("saved", "now", "field", "was", "is_now"), [
    ({"name": "digits"}, {"name": "digits", "n_embd": 32}, "task.n_embd", "64", "32"),  # (digits' hidden width)
    ({"name": "digits"}, {"name": "digits", "batch_size": 8}, "task.batch_size", "32", "8"),  # (its data stream)
    ({"name": "linear"}, {"name": "linear", "batch_size": 8}, "task.batch_size", "32", "8"),
    ({"preset": "gpt2-small"}, {**GPT2_SIZES, "n_head": 8}, "task.n_head", "12", "8"),
    ({"name": "digits", "n_embd": 32}, {"name": "charlm", "n_embd": 64}, "task.name", "'digits'", "'charlm'"),
])
def test_check_resume_still_refuses_a_task_setting_the_task_reads(saved, now, field, was, is_now):
    with pytest.raises(InputError) as err:
        ck.check_resume(_task_resume(saved), _with(task=now), world_size=1)
    assert one_line(err) == f"--resume: {field} was {was} in the checkpoint, now {is_now}; a resumed run must keep it"


def test_check_resume_reads_an_older_checkpoints_fp8_exclude_listed_twice_as_it_ran():
    # a name listed twice in fp8.exclude (refused since) ran as if once; config.yaml reads it so
    # (config.as_it_ran), and so must the checkpoint's own copy, else its resume is refused
    fp8 = {**BASE, "precision": "fp8", "fp8": {"exclude": ["head", "lm"]}}
    saved = validate(fp8).model_dump(mode="json")
    saved["fp8"]["exclude"] = ["head", "lm", "head"]
    resume = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, saved)), Path("run"))
    ck.check_resume(resume, validate(fp8), world_size=1)
    with pytest.raises(InputError) as err:  # (a real change is still one)
        ck.check_resume(resume, validate({**fp8, "fp8": {"exclude": ["head"]}}), world_size=1)
    assert one_line(err).startswith("--resume: fp8.exclude was ['head', 'lm'] in the checkpoint, now ['head']")


def test_check_resume_refuses_a_checkpoint_whose_config_lacks_a_fixed_key():
    saved = validate(BASE).model_dump(mode="json")
    del saved["precision"]
    resume = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, saved)), Path("run"))
    with pytest.raises(InputError) as err:
        ck.check_resume(resume, _with(), world_size=1)
    assert one_line(err).startswith("--resume: precision was null in the checkpoint, now 'bf16'")


@pytest.mark.parametrize("garbage", ["fp4", "FP16", "", 42, True, None, ["fp16"], {"name": "fp16"}])
def test_check_resume_refuses_a_checkpoint_with_a_garbage_precision_in_one_line(garbage):
    # the checkpoint's config is hostile input: whatever its precision holds, the scaler's rule in
    # _effective must not raise (no scaler for a name that is not fp16), and the answer is the refusal
    saved = {**validate(BASE).model_dump(mode="json"), "precision": garbage}
    assert ck._effective(saved)["scaler"]["enabled"] is False
    resume = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, saved)), Path("run"))
    for now in (_with(), _with(precision="fp16")):
        with pytest.raises(InputError) as err:
            ck.check_resume(resume, now, world_size=1)
        was = "true" if garbage is True else "null" if garbage is None else repr(garbage)  # (YAML's: review 53a)
        assert one_line(err) == (f"--resume: precision was {was} in the checkpoint, now {now.precision!r}; "
                                 "a resumed run must keep it")


def test_check_resume_refuses_a_checkpoint_whose_config_lacks_a_fixed_section():
    saved = validate(BASE).model_dump(mode="json")
    del saved["optimizer"]  # load_checkpoint accepts any payload with a "config" entry
    resume = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, saved)), Path("run"))
    with pytest.raises(InputError) as err:
        ck.check_resume(resume, _with(), world_size=1)
    assert "optimizer.name" in one_line(err)


def test_check_resume_refuses_turning_the_loss_scaler_off_or_on_as_it_takes_effect():
    fp16 = {**BASE, "precision": "fp16"}
    saved = validate(fp16).model_dump(mode="json")  # scaler.enabled null: on, for fp16
    resume = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, saved)), Path("run"))
    with pytest.raises(InputError) as err:
        ck.check_resume(resume, validate({**fp16, "scaler": {"enabled": False}}), world_size=1)
    assert one_line(err) == "--resume: scaler.enabled was true in the checkpoint, now false; a resumed run must keep it"
    ck.check_resume(resume, validate({**fp16, "scaler": {"enabled": True}}), world_size=1)  # null and true: both on


def test_the_fp8_recipe_is_fixed_on_resume_only_where_it_takes_effect():
    fp8 = {"precision": "fp8", "fp8": {"recipe": "tensorwise"}}
    saved = Resume(Loaded(Path("run/checkpoints/step-00000008.pt"),
                          _meta(8, validate({**BASE, **fp8}).model_dump(mode="json"), 1)), Path("run"))
    with pytest.raises(InputError) as err:
        ck.check_resume(saved, _with(precision="fp8", fp8={"recipe": "rowwise"}), world_size=1)
    assert one_line(err) == ("--resume: fp8.recipe was 'tensorwise' in the checkpoint, now 'rowwise'; "
                             "a resumed run must keep it")
    # under bf16 the section changes nothing: no refusal, and a checkpoint without it resumes
    ck.check_resume(_resume(), _with(fp8={"recipe": "rowwise"}), world_size=1)
    old = validate(BASE).model_dump(mode="json")
    del old["fp8"]
    ck.check_resume(Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), _meta(8, old, 1)), Path("run")),
                    _with(), world_size=1)


def _spike_resume(rollback: dict[str, Any], monitors: dict[str, Any]) -> Resume:
    saved = validate({**BASE, "rollback": rollback, "checkpoint": {"every": 4}}).model_dump(mode="json")
    meta = _meta(8, saved)
    meta[STATE]["monitors"] = monitors
    return Resume(Loaded(Path("run/checkpoints/step-00000008.pt"), meta), Path("run"))


def test_the_loss_spike_window_is_fixed_on_resume_only_where_the_checkpoint_holds_one():
    # review 58a: rollback.window was refused whatever the checkpoint held, so loss_spike turned
    # on at resume was stuck with the window the first run's config happened to have (50)
    window = LossSpikeDetector(50, 6.0).state_dict()
    spike = {"triggers": ["loss_spike"]}
    none = _spike_resume({}, {})  # (a run with no loss_spike: no detector, no window saved)
    ck.check_resume(none, _with(rollback={"window": 7}), world_size=1)
    ck.check_resume(none, _with(rollback={**spike, "window": 4}, checkpoint={"every": 4}), world_size=1)
    # a window the checkpoint holds keeps its size: the run's own, or one a resume with the
    # trigger off carried on (step._Monitors keeps it for a later resume that turns it back on)
    for held in (_spike_resume(spike, {"loss_spike": window}), _spike_resume({}, {"loss_spike": window})):
        for rollback in ({**spike, "window": 7}, {"window": 7}):
            with pytest.raises(InputError) as err:
                ck.check_resume(held, _with(rollback=rollback, checkpoint={"every": 4}), world_size=1)
            assert one_line(err) == "--resume: rollback.window was 50 in the checkpoint, now 7; a resumed run must keep it"
        ck.check_resume(held, _with(rollback={"z": 3.0}, checkpoint={"every": 4}), world_size=1)  # (z: no state)


def test_every_fixed_key_has_a_refusal_test():
    fields = [field for _, field, _, _ in FIXED_CHANGES] + ["scaler.enabled", "fp8.recipe", "rollback.window"]  # the tests above
    for key in RESUME_FIXED:
        assert any(f == key or f.startswith(f"{key}.") for f in fields), key


@pytest.mark.parametrize("change", [
    {"steps": 40}, {"optimizer": {"name": "adamw", "lr": 0.5}}, {"checkpoint": {"every": 3}},
    {"monitor": {"alert_rate": 0.5}}, {"max_norm": 0.0},
])
def test_check_resume_accepts_changes_outside_the_fixed_keys(change):
    ck.check_resume(_resume(), _with(**change), world_size=1)


def test_check_resume_accepts_a_complete_run_so_its_card_can_be_rewritten():
    ck.check_resume(_resume(step=8), _with(steps=8), world_size=1)


@pytest.mark.parametrize("steps", [7, 5, 1])
def test_check_resume_refuses_a_checkpoint_beyond_the_runs_steps(steps):
    with pytest.raises(InputError) as err:
        ck.check_resume(_resume(step=8), _with(steps=steps), world_size=1)
    line = one_line(err)
    assert "at step 8" in line and ("1 step;" if steps == 1 else f"{steps} steps;") in line and "steps=N" in line


def test_check_resume_accepts_one_step_left():
    ck.check_resume(_resume(step=8), _with(steps=9), world_size=1)


def test_check_resume_refuses_another_world_size():
    with pytest.raises(InputError) as err:
        ck.check_resume(_resume(world_size=2), _with(), world_size=1)
    assert "saved by 2 processes, this run has 1" in one_line(err)
    with pytest.raises(InputError):  # a checkpoint without the entry was saved by one process
        ck.check_resume(_resume(world_size=None), _with(), world_size=4)
    ck.check_resume(_resume(world_size=None), _with(), world_size=1)
    ck.check_resume(_resume(world_size=2), _with(), world_size=2)
    ck.check_resume(_resume(world_size=2), _with())  # world size not given: not checked


# ---------------------------------------------------------------------------- the real parts


def _trained(seed: int) -> tuple[nn.Linear, torch.optim.SGD]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(5, 4)), torch.randn(5, 3)).backward()
        opt.step()
    return model, opt


def _parts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {MODEL: ModelState(model), OPTIMIZER: OptimizerState(model, opt)}


def test_model_and_optimizer_state_round_trip_a_linear_with_sgd_momentum(tmp_path):
    a, opt_a = _trained(0)
    CheckpointManager(tmp_path, _parts(a, opt_a), keep=1, meta=lambda: _meta(2)).save(2)
    b, opt_b = _trained(1)  # other weights, other momentum
    assert not torch.equal(a.weight, b.weight)
    manager = CheckpointManager(tmp_path, _parts(b, opt_b), keep=1)
    manager.restore(manager.load())
    for name, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], value), name
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(opt_a.state[pa]["momentum_buffer"], opt_b.state[pb]["momentum_buffer"])
    # and they train on identically (the momentum is really the one the optimizer uses)
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    for model, opt in ((a, opt_a), (b, opt_b)):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def test_rng_state_round_trip_through_a_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, {RNG: RngState(DistInfo())}, keep=1, meta=lambda: _meta(1))
    torch.manual_seed(123)
    manager.save(1)
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    manager.restore(manager.load())
    got = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_rng_state_of_one_process_is_one_state_and_each_rank_restores_its_own():
    state = RngState(DistInfo()).state_dict()
    assert isinstance(state, dict) and "torch" in state
    torch.manual_seed(1)
    first = ckpt.rng_state()
    torch.manual_seed(2)
    second = ckpt.rng_state()
    expected = torch.rand(3)  # what rank 1 (seeded 2) draws next
    torch.manual_seed(7)
    RngState(DistInfo(rank=1, world_size=2, local_rank=1)).load_state_dict([first, second])
    assert torch.equal(torch.rand(3), expected)


# ---------------------------------------------------------------------------- issue 16: leftovers, checked loads


def test_save_removes_partial_saves_of_other_processes_and_keeps_its_own(tmp_path):
    import os

    run = Run(tmp_path)
    others = [tmp_path / ".step-00000003.pt.tmp-4242", tmp_path / ".step-00000001.pt.tmp-1"]
    own = tmp_path / f".step-00000009.pt.tmp-{os.getpid()}"
    for path in (*others, own):
        path.write_bytes(b"a save killed halfway")
    (tmp_path / "notes.txt").write_text("not a checkpoint", encoding="utf-8")
    run.save(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([own.name, "notes.txt", "step-00000002.pt"])


def test_remove_partial_removes_every_partial_save_on_rank_0_only(tmp_path):
    import os

    paths = [tmp_path / ".step-00000003.pt.tmp-4242", tmp_path / f".step-00000004.pt.tmp-{os.getpid()}"]
    for path in paths:
        path.write_bytes(b"")
    assert Run(tmp_path, dist=DistInfo(rank=1, world_size=2)).manager.remove_partial() == []
    assert sorted(Run(tmp_path).manager.remove_partial()) == sorted(paths)
    assert list(tmp_path.iterdir()) == []
    assert Run(None).manager.remove_partial() == []


def test_load_with_a_check_passes_over_checkpoints_it_refuses(tmp_path):
    run = Run(tmp_path)
    for step in (2, 4, 6):
        run.save(step)
    seen: list[int] = []

    def check(loaded: Loaded) -> None:
        seen.append(loaded.step)
        if loaded.step == 6:
            raise InputError(f"{loaded.path}: saved by another run")

    run.manager.check = check
    assert run.manager.load().step == 4 and seen == [6, 4]
    assert run.manager.load(before_step=4).step == 2
    run.manager.check = lambda loaded: (_ for _ in ()).throw(InputError(f"{loaded.path}: no"))
    with pytest.raises(InputError) as err:
        run.manager.load()
    assert "no loadable checkpoint" in one_line(err) and "step-00000006.pt: no" in str(err.value)


def test_find_resume_refuses_a_readable_newest_checkpoint_that_is_not_the_runs_instead_of_passing_it_over(tmp_path):
    run = _run_folder(tmp_path / "run", (2, 4))
    ckpt.save_checkpoint(run / "checkpoints" / "step-00000009.pt", _meta(4))  # step 4 under the name of step 9
    with pytest.raises(InputError) as err:
        ck.find_resume(run)
    assert one_line(err).startswith(f"{run / 'checkpoints' / 'step-00000009.pt'}: named for step 9")
    (run / "checkpoints" / "step-00000009.pt").write_bytes(b"torn")  # what a kill leaves: passed over
    assert ck.find_resume(run).loaded.step == 4


def test_find_resume_takes_the_run_folders_id_and_refuses_another_runs_checkpoint(tmp_path):
    run = _run_folder(tmp_path / "run", (2,))
    mine, other = "a" * 32, "b" * 32
    (run / "run-id").write_text(mine + "\n", encoding="ascii")
    assert ck.find_resume(run).run_id == mine  # an old checkpoint without an id is judged by its config
    ckpt.save_checkpoint(run / "checkpoints" / "step-00000004.pt", {**_meta(4), ck.RUN_ID: other})
    with pytest.raises(InputError) as err:
        ck.find_resume(run)
    assert "saved by another run" in one_line(err)
    ckpt.save_checkpoint(run / "checkpoints" / "step-00000004.pt", {**_meta(4), ck.RUN_ID: mine})
    resume = ck.find_resume(run)
    assert resume.loaded.step == 4 and resume.run_id == mine and resume.picked
    assert not ck.find_resume(run / "checkpoints" / "step-00000004.pt").picked


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with the gloo backend is not available")
def test_a_ddp_runs_optimizer_state_loads_into_an_fsdp2_model(launches):
    # distributed.strategy ddp -> fsdp2 on resume: the state keyed by position was refused
    # ("does not fit this run ('state.0.step')"); now keyed by name, every moment arrives. In a
    # process of its own (a one-process gloo group): the module's early job
    done = launches["by_name"]
    assert done.rc == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def early(work: Path) -> dict[str, Any]:
    """The one-process gloo script of the test above, run to its end: an early job (conftest.py:
    started at collection, off the suite's own process; the tests that read it run last)."""
    import sys

    from helpers import EARLY_TIMEOUT_S, run_to_end, torchrun_env

    script = Path(__file__).resolve().parent.parent / "dist_scripts" / "optimizer_by_name.py"
    return {"by_name": run_to_end("by_name", [sys.executable, str(script)], work / "by_name",
                                  timeout_s=EARLY_TIMEOUT_S, env=torchrun_env())}


def test_a_state_keyed_by_position_is_renamed_by_the_optimizers_parameter_order():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD([{"params": [model[1].weight, model[1].bias]},
                           {"params": [model[0].weight, model[0].bias], "lr": 0.5}], lr=0.1)
    state = opt.state_dict()
    by_name = ck.OptimizerState(model, opt, fsdp=True)._by_name(state)
    assert [g["params"] for g in by_name["param_groups"]] == [["1.weight", "1.bias"], ["0.weight", "0.bias"]]
    assert by_name["param_groups"][1]["lr"] == 0.5
    assert ck.OptimizerState(model, opt, fsdp=True)._by_name(by_name) is by_name  # by name already


# ---------------------------------------------------------------------------- what --resume says it was given


def test_find_resume_of_nothing_there_says_so(tmp_path):
    with pytest.raises(InputError) as err:
        ck.find_resume(tmp_path / "nowhere")
    assert one_line(err) == f"--resume: no such run folder or checkpoint file: {tmp_path / 'nowhere'}"


def test_find_resume_of_the_folder_above_the_run_folders_names_one_of_them(tmp_path):
    runs = tmp_path / "runs"
    for name in ("20240101-000000", "20240102-000000"):
        _run_folder(runs / name, (2,))
        (runs / name / "config.yaml").write_text("steps: 5\n", encoding="utf-8")
    with pytest.raises(InputError) as err:
        ck.find_resume(runs)
    assert one_line(err) == (f"--resume: {runs} is not a run folder (no config.yaml, no checkpoints/); pass one of "
                             f"its run folders ({runs}/<name>, e.g. {runs / '20240102-000000'}) or a checkpoint file")
    with pytest.raises(InputError) as err:  # the run's checkpoints/ folder: its run folder is the one
        ck.find_resume(runs / "20240101-000000" / "checkpoints")
    assert one_line(err) == (f"--resume: {runs / '20240101-000000' / 'checkpoints'} is not a run folder (no "
                             f"config.yaml, no checkpoints/); pass its run folder {runs / '20240101-000000'} or a "
                             "checkpoint file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError) as err:  # an empty folder: no example to give
        ck.find_resume(tmp_path / "empty")
    assert one_line(err).endswith("is not a run folder (no config.yaml, no checkpoints/); pass runs/<name> or a "
                                  "checkpoint file")


@pytest.mark.parametrize("section, why", [
    ("checkpoint:\n  enabled: true\n  every: 0\n",
     " (checkpoint.every is 0: the run saves only at its end, at a guard's stop and on Ctrl-C/SIGTERM)"),
    ("checkpoint:\n  enabled: false\n  every: 0\n", " (checkpoint.enabled is false: the run saves none)"),
    ("checkpoint:\n  enabled: true\n  every: 5\n", ""),
    ("steps: [\n", ""),  # an unreadable config.yaml explains nothing (the resume would say what is wrong)
])
def test_find_resume_of_a_run_with_no_checkpoint_says_when_its_config_saves_them(tmp_path, section, why):
    run = _run_folder(tmp_path / "run", ())
    (run / "config.yaml").write_text(section, encoding="utf-8")
    with pytest.raises(InputError) as err:
        ck.find_resume(run)
    assert one_line(err) == f"no checkpoint in {run / 'checkpoints'}{why}"


def test_ranks_configs_that_differ_are_refused_and_task_options_only_said():
    # (the torchrun launches C of test_torchrun_guards run the refusal for real; here its edges)
    import warnings

    from ampguard.checkpointer import check_same_configs
    from ampguard.errors import AmpguardWarning

    base = {"steps": 12, "optimizer": {"lr": 0.1}, "log": {"dir": "runs"}, "task": {"options": {"data": "/n0/d"}}}
    with pytest.raises(InputError, match=r"^the ranks were given different configs: optimizer.lr is 0.1 on rank 0, "
                                         r"0.5 on rank 2;"):
        check_same_configs([base, base, {**base, "optimizer": {"lr": 0.5}}])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        check_same_configs([base, {**base, "log": {"dir": "/n1/runs"}}])  # where rank 1 would write: nothing said
        assert said == []
        check_same_configs([base, {**base, "task": {"options": {"data": "/n1/d"}}}])
    assert [w.category for w in said] == [AmpguardWarning]
    assert str(said[0].message).startswith("task.options.data is '/n0/d' on rank 0, '/n1/d' on rank 1: the run goes on")


class _Masked(nn.Module):
    """A Linear and a causal attention mask of -inf above the diagonal: a buffer, not a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))


def test_a_weight_that_is_not_finite_is_refused_and_a_buffer_that_is_not_is_taken(tmp_path):
    # NaN weights would skip every resumed step; a mask of -inf is what the model is (the check
    # looked at the buffers too: a model with an attention mask could never resume)
    model = _Masked()
    manager = ck.CheckpointManager(None, {ck.MODEL: ck.ModelState(model)}, keep=1)
    manager.check_fits(ck.Loaded(tmp_path / "step-00000002.pt", {ck.MODEL: model.state_dict()}))
    spoiled = {**model.state_dict(), "fc.bias": torch.tensor([0.0, float("inf"), 0.0, 0.0])}
    with pytest.raises(InputError, match=r"step-00000002\.pt: bad checkpoint: its model's fc\.bias holds inf: a run "
                                         r"resumed from it would skip every step"):
        manager.check_fits(ck.Loaded(tmp_path / "step-00000002.pt", {ck.MODEL: spoiled}))
    with pytest.raises(InputError, match=r"its model does not match the one this run builds: fc\.weight is float16 in "
                                         r"the checkpoint, float32 here"):
        manager.check_fits(ck.Loaded(tmp_path / "step-00000002.pt",
                                     {ck.MODEL: {**model.state_dict(), "fc.weight": model.fc.weight.detach().half()}}))
