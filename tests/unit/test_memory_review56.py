"""Review 56c, what ampguard kept alive that it had no more use for:

- F1: ``validate --checkpoint`` and ``locate --checkpoint`` kept the checkpoint's whole payload (the
  weights' copy and the AdamW moments, 3x the parameters) on the run's device for the whole
  command; they keep its step and loss scale, the rest is freed before the passes and the replay;
- F2: a resumed run kept the weights of the checkpoint it resumed from (``resume.loaded.payload``,
  held by the Trainer and the CLI) until it ended;
- F4: a monitor window cost ~130 B a step of ``monitor.window`` (lists and a deque of float
  objects); it is a byte a step a flag window, 8 for the scales.

Memory is measured by what stays referenced (weak references to the loaded tensors) and by what
Python allocated (tracemalloc), never by timing or the RSS.
"""

from __future__ import annotations

import gc
import shutil
import weakref
from pathlib import Path

import pytest
import torch

from ampguard import checkpoint as ckpt
from ampguard import checkpointer as ck
from ampguard import locate, validate
from ampguard.config import validate as config_of
from ampguard.run_folder import RunPaths
from ampguard.tasks import build_task
from ampguard.train import run as train_run
from ampguard.trainer import Trainer


def settings(tmp_path: Path, steps: int) -> dict:
    return {"task": {"name": "linear"}, "steps": steps, "precision": "fp32", "device": "cpu",
            "eval": {"enabled": False}, "checkpoint": {"every": 1},
            "log": {"dir": str(tmp_path / "runs"), "name": "a", "plot": False}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """A 2-step AdamW run (its optimizer state holds moments) and its folder."""
    tmp_path = tmp_path_factory.mktemp("trained")
    config = config_of(settings(tmp_path, 2))
    result = train_run(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=10**6,
                       print_fn=lambda line: None)
    assert int(result.exit_code) == 0
    return tmp_path, tmp_path / "runs" / "a"


def tensors_of(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_of(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_of(v)]
    return []


@pytest.fixture
def loaded(monkeypatch) -> list[weakref.ref]:
    """Weak references to every tensor of each checkpoint payload read from disk (the one reader,
    ``checkpoint.load_checkpoint``, wrapped: what it returns is what the command holds)."""
    refs: list[weakref.ref] = []
    read = ckpt.load_checkpoint

    def reading(*args, **kwargs):
        payload = read(*args, **kwargs)
        refs.extend(weakref.ref(t) for t in tensors_of(payload))
        return payload

    monkeypatch.setattr(ckpt, "load_checkpoint", reading)
    return refs


def alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(r() is not None for r in refs)


def test_load_trained_weights_keeps_only_the_step_the_config_the_scale_and_where_the_data_went_on(trained, loaded):
    folder, run_dir = trained
    config = config_of(settings(folder, 2))
    model = build_task(config).model
    path = ckpt.list_checkpoints(run_dir / "checkpoints")[-1]
    saved = ck.load_trained_weights(model, path, config, "cpu")
    read = list(loaded)
    assert alive(read) == 0  # none of what was read is held: the returned dict has no tensor
    weights = ckpt.load_checkpoint(path)["model"]
    assert len(read) > len(weights) >= 2  # (the optimizer's moments were read too)
    assert all(torch.equal(model.state_dict()[name], w) for name, w in weights.items())  # the weights went in
    assert saved["step"] == 2 and set(saved["state"]) == {"scaler"}
    # (and two numbers: the data's position and the run's id, for locate's replay of step N: review 58d; the
    # rollback log's lines, and the policy log where there is one, for the position's bound: session 60d)
    assert set(saved) == {"step", "config", "state", "data_position", "run_id", "rollbacks"}
    assert isinstance(saved["data_position"], int) and isinstance(saved["run_id"], str)


@pytest.mark.parametrize("command", ["locate", "validate"])
def test_validate_and_locate_hold_nothing_of_the_checkpoint_while_they_run_the_model(trained, loaded, monkeypatch,
                                                                                   command):
    folder, run_dir = trained
    path = str(ckpt.list_checkpoints(run_dir / "checkpoints")[-1])
    seen: list[int] = []
    module, name = (locate, "diagnose_group") if command == "locate" else (validate, "compare")
    passes = getattr(module, name)

    def counted(*args, **kwargs):
        seen.append(alive(loaded))  # as the replay / the passes start
        return passes(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    config = config_of({**settings(folder, 2), "validation": {"precisions": ["bf16"], "checkpoint": path}})
    if command == "locate":
        locate.run(config, step=1, checkpoint=path)
    else:
        validate.run(config, checkpoint=path, out=folder / "validated")
    assert loaded and seen == [0]  # (all of them: the weights' copy and the AdamW moments)


def test_a_resumed_run_lets_the_checkpoints_weights_and_optimizer_state_go_once_restored(trained, tmp_path):
    folder, run_dir = trained
    run = tmp_path / "runs" / "a"
    shutil.copytree(run_dir, run)  # (the module's run stays as it was)
    resume = ck.find_resume(run)
    refs = [weakref.ref(t) for t in resume.loaded.payload[ck.MODEL].values()]
    config = config_of(settings(tmp_path, 4))
    trainer = Trainer(config, outputs=lambda: RunPaths.existing(run), console_every=10**6, stats_every=None,
                      print_fn=lambda line: None, progress=False, resume=resume)
    assert alive(refs) == 0  # (the model's weights are a copy of them: the payload's stayed for the whole run)
    assert ck.MODEL not in resume.loaded.payload and ck.OPTIMIZER not in resume.loaded.payload
    result = trainer.run()  # what is read after the restore is still there
    assert int(result.exit_code) == 0 and result.monitor.steps == 4
    # review 56n: a second Trainer given the same Resume (a caller's retry) met a model of None and refused
    # a sound checkpoint as one that does not fit; it is told the Resume was used, and how to read it again
    with pytest.raises(ValueError, match=r"this Resume was restored by a Trainer already, .*find_resume"):
        Trainer(config, outputs=lambda: RunPaths.existing(run), console_every=10**6, stats_every=None,
                print_fn=lambda line: None, progress=False, resume=resume)
    again = Trainer(config, outputs=lambda: RunPaths.existing(run), console_every=10**6, stats_every=None,
                    print_fn=lambda line: None, progress=False, resume=ck.find_resume(run))
    assert again.resume is not None and again.resume.loaded.let_go
