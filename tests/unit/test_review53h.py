"""Review 53h: diagnostics' and rare paths' work on every step. (1) With accumulation and
checkpoints on (the default), every group's start took every RNG's state (NumPy's and
``random``'s most of its ~50 us, 17% of the linear task's step) for data that fails inside a
group, which a built-in task's data never draws from. (2) The first-skip diagnosis kept every
micro-batch (torch's RNG state, a scale copy, the batch) for the rest of the run after its finding,
which nothing reads unless ``diagnose.strict`` diagnoses later skips."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ampguard.checkpoint import rng_snapshot, rng_state, set_rng_state
from ampguard.config import validate
from ampguard.guards import FirstSkipDiagnosis
from ampguard.run_folder import RunPaths
from ampguard.step import AmpTrainState
from ampguard.trainer import Trainer

CUDA = ["cuda"] if torch.cuda.is_available() else []

FACTORY = '''
import torch
from torch import nn


def build(config):
    def data():
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)

    return nn.Linear(2, 1), data, nn.functional.mse_loss
'''


def trained(tmp_path, task, **settings):
    config = validate({"task": task, "steps": 2, "precision": "fp32", "device": "cpu", "accumulation_steps": 2,
                       "eval": {"enabled": False}, "log": {"dir": str(tmp_path / "runs"), "name": "a", "plot": False},
                       **settings})
    trainer = Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=10**6, stats_every=None,
                      print_fn=lambda line: None, progress=False, resume=None)
    assert int(trainer.run().exit_code) == 0
    return trainer


def test_a_built_in_tasks_group_start_notes_torchs_rngs_alone(tmp_path):
    # its data draws from its own generators and the model from torch's: NumPy's and random's states were
    # taken for nothing at every step
    assert sorted(trained(tmp_path, {"name": "linear"})._group_rng) == sorted(["torch"] + CUDA)


def test_a_factorys_group_start_notes_every_rng_raw(tmp_path):
    (tmp_path / "f.py").write_text(FACTORY, encoding="utf-8")
    noted = trained(tmp_path, {"factory": f"{tmp_path / 'f.py'}:build"})._group_rng
    assert sorted(noted) == sorted(["torch", "random", "numpy"] + CUDA)
    assert type(noted["numpy"]) is tuple  # as np.random.get_state() gives it: converted for no file


def test_a_raw_snapshot_puts_back_what_the_checkpoints_form_does():
    np.random.standard_normal()  # (one gauss held: has_gauss 1, put back too)
    raw, saved = rng_snapshot(), rng_state()
    first = torch.rand(3), random.random(), np.random.standard_normal(3)
    for state in (raw, saved):
        set_rng_state(state)
        again = torch.rand(3), random.random(), np.random.standard_normal(3)
        assert torch.equal(again[0], first[0]) and again[1] == first[1] and np.array_equal(again[2], first[2])


# ---------------------------------------------------------------------------- (2) the first skip's captures

def diagnosed():
    model = torch.nn.Linear(2, 1)
    state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss,
                          precision="bf16", accumulation_steps=2)
    return state, FirstSkipDiagnosis(state, model)


def group(state, diagnosis, first, second, strict=False):
    for x in (first, second):
        batch = (x, torch.zeros(4, 1))
        if strict:  # (the trainer's calls)
            diagnosis.capture(batch, fresh=True)
        else:
            diagnosis.capture(batch)
        record = state.step(*batch)
    return diagnosis.after(record, fresh=strict)


ONES, NAN, INF = torch.ones(4, 2), torch.full((4, 2), float("nan")), torch.full((4, 2), float("inf"))


def test_after_the_first_skips_finding_later_micro_batches_are_not_kept():
    state, diagnosis = diagnosed()
    assert group(state, diagnosis, ONES, NAN).startswith("step 1 (non_finite_loss): first nan")
    found = diagnosis.found
    for x in (ONES, INF):  # the next group: nothing reads it, a later skip repeats the finding
        diagnosis.capture((x, torch.zeros(4, 1)))
        assert diagnosis.group == [] and diagnosis.rng == []
        record = state.step(x, torch.zeros(4, 1))
    assert record.skipped and diagnosis.after(record) == found


def test_a_resumed_runs_finding_keeps_nothing_and_strict_mode_still_diagnoses_a_later_skip():
    for strict in (False, True):
        state, diagnosis = diagnosed()
        diagnosis.found = "step 3 (non_finite_grad): first inf under bf16: in fc1"  # (an earlier part's)
        said = group(state, diagnosis, ONES, INF, strict=strict)
        if strict:
            assert said.startswith("step 1 (non_finite_loss): first inf under bf16 in micro-batch 2 of 2"), said
            assert len(diagnosis.group) == 2
        else:
            assert said == diagnosis.found and diagnosis.group == []


@pytest.mark.parametrize("strict", [False, True])
def test_a_group_begun_before_its_finding_is_kept_whole(strict):
    # decided at the group's start: a finding made while a group is open (in no trainer's loop, which judges a
    # record once its group closed) leaves that group's keeping as it began
    state, diagnosis = diagnosed()
    diagnosis.capture((ONES, torch.zeros(4, 1)), fresh=strict)
    state.step(ONES, torch.zeros(4, 1))
    diagnosis.found = "step 3 (non_finite_grad): first inf under bf16: in fc1"
    diagnosis.capture((NAN, torch.zeros(4, 1)), fresh=strict)
    assert len(diagnosis.group) == len(diagnosis.rng) == 2


def test_a_runs_later_groups_are_not_kept_once_its_first_skip_is_diagnosed(tmp_path):
    trainer = trained(tmp_path, {"name": "linear"}, steps=4, precision="bf16", inject=["nan_loss@2"],
                      diagnose={"first_skip": True})
    assert trainer.diagnosis.found.startswith("step 2 (non_finite_loss)")
    assert trainer.diagnosis.group == [] and trainer.diagnosis.rng == []  # (steps 3 and 4's: not kept)
