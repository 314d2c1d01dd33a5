"""Review 53h: rare paths' work on every step. (1) With accumulation and checkpoints on (the
default), every group's start took every RNG's state (NumPy's and ``random``'s most of its ~50 us,
17% of the linear task's step) for data that fails inside a group, which a built-in task's data
never draws from."""

from __future__ import annotations

import random

import numpy as np
import torch

from ampguard.checkpoint import rng_snapshot, rng_state, set_rng_state
from ampguard.config import validate
from ampguard.run_folder import RunPaths
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

