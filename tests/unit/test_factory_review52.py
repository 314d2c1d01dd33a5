"""Review 52h: data that draws from the global RNG as a pass begins (a shuffle with
``torch.randperm``, a ``DataLoader(shuffle=True)`` without a generator of its own) resumed on
other batches: a resume reads the pass's start again from the checkpoint's RNG state, not the
one the pass began at, and nothing said so. Start-up now reads it as a resume would and says so;
a random augmentation drawn per batch resumes exactly, and is not said."""

from __future__ import annotations

import pytest

from helpers import caught_warnings, write

from ampguard.config import load_config
from ampguard.tasks import build_task

FACTORIES = '''
import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(5)
X, Y = torch.randn(12, 4, generator=g), torch.randn(12, 1, generator=g)


def global_perm(config):
    def data():
        perm = torch.randperm(12)
        for i in range(0, 12, 3):
            yield X[perm[i:i + 3]], Y[perm[i:i + 3]]
    return nn.Linear(4, 1), data, F.mse_loss


def numpy_perm(config):
    def data():
        perm = np.random.permutation(12)
        for i in range(0, 12, 3):
            yield X[perm[i:i + 3]], Y[perm[i:i + 3]]
    return nn.Linear(4, 1), data, F.mse_loss


def unseeded_loader(config):
    return nn.Linear(4, 1), (lambda: DataLoader(TensorDataset(X, Y), batch_size=3, shuffle=True)), F.mse_loss


def seeded_loader(config):
    loader = DataLoader(TensorDataset(X, Y), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))
    return nn.Linear(4, 1), loader, F.mse_loss


def seek_through_data(config):  # (batches_from reads data's own seeded DataLoader)
    import itertools
    loader = DataLoader(TensorDataset(X, Y), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))

    def batches_from(start):
        def passes():
            while True:
                yield from loader
        return itertools.islice(passes(), start, None)
    return {"model": nn.Linear(4, 1), "data": loader, "loss_fn": F.mse_loss, "batches_from": batches_from}


class Augmented(torch.utils.data.Dataset):  # (a draw per example, in the loader: no shuffle)
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return X[i] + 0.1 * torch.randn(4), Y[i]


def augmented_loader(config):
    return nn.Linear(4, 1), DataLoader(Augmented(), batch_size=3), F.mse_loss


def augmented_loader_fn(config):
    return nn.Linear(4, 1), (lambda: DataLoader(Augmented(), batch_size=3)), F.mse_loss


def augmented(config):  # (a draw per batch, from the RNG state of the moment: a resume draws it again so)
    def data():
        for i in range(0, 12, 3):
            yield X[i:i + 3] + 0.1 * torch.randn(3, 4), Y[i:i + 3]
    return nn.Linear(4, 1), data, F.mse_loss
'''

SAID = ("data draws from the global RNG as a pass begins (a shuffle without a generator of its own: torch.randperm, "
        "a DataLoader(shuffle=True) without generator=, np.random.permutation)")


@pytest.mark.parametrize("fn", ["global_perm", "numpy_perm", "unseeded_loader"])
def test_data_shuffled_from_the_global_rng_as_a_pass_begins_is_said_to_resume_on_other_batches(tmp_path, fn):
    path = write(tmp_path / "f52.py", FACTORIES)
    said = caught_warnings(lambda: build_task(load_config(None, [f"task.factory={path}:{fn}"])))
    assert len(said) == 1 and SAID in said[0], said
    assert "a resume, a rollback or locate's replay inside a pass reads that pass in another order" in said[0]


@pytest.mark.parametrize("fn", ["seeded_loader", "augmented", "augmented_loader", "augmented_loader_fn"])
def test_data_that_resumes_exactly_is_not_said(tmp_path, fn):
    path = write(tmp_path / "f52.py", FACTORIES)
    assert caught_warnings(lambda: build_task(load_config(None, [f"task.factory={path}:{fn}"]))) == []


def test_a_batches_from_that_reads_datas_own_loader_starts_where_data_does(tmp_path):
    # review 52h: batches_from(0) read the loader's next shuffle (its generator went on from the
    # start-up's reads): refused as "does not start with data's batch 0"; at run time a resume's
    # stream went on from whatever read the loader before it
    import torch

    path = write(tmp_path / "f52.py", FACTORIES)
    task = build_task(load_config(None, [f"task.factory={path}:seek_through_data"]))
    stream = task.batches()
    run = [next(stream)[0] for _ in range(6)]  # (two passes of four: the second reshuffled)
    for start in (0, 3, 5, 3):  # (a resume, a rollback, another: each from the factory's state)
        assert torch.equal(next(iter(task.stream(start)))[0], run[start]), start


def test_eval_settings_a_task_does_not_read_are_said_once_by_a_training_run(tmp_path):
    # review 52h: eval.batches (charlm's) on another task, eval.every on a factory with no evaluate, were
    # ignored unsaid; review 52i: said twice with evaluation off, and again by every resume, validate, locate
    from ampguard.tasks import eval_unread

    path = write(tmp_path / "f52.py", FACTORIES)

    def said(*overrides):
        config = load_config(None, list(overrides))
        return eval_unread(config, build_task(config))

    assert said("task.name=digits", "eval.batches=3") == (
        "task digits does not read eval.batches (charlm's number of held-out batches): ignored")
    assert said(f"task.factory={path}:seeded_loader", "eval.every=5") == (
        "task factory does not read eval.every (it has no held-out evaluation: no evaluate): ignored")
    assert said("task.name=linear", "eval.every=5") is None  # (read)
    assert said("task.name=digits", "eval.batches=3", "eval.enabled=false") is None  # (the config's line says it)


def test_a_checkpoints_look_at_the_next_batch_leaves_the_runs_data_as_it_was(tmp_path):
    # review 52i: a checkpoint's hash of the next batch (data_next) read through batches_from, which rewinds
    # and reads the loader the run reads: at a pass's end it drew the next pass's order, and the run
    # trained on another than without checkpoints (from step 5 with checkpoint.every=4, four batches a pass)
    import torch

    from ampguard.data import DataStream
    from ampguard.faults import FaultInjector

    path = write(tmp_path / "f52.py", FACTORIES)
    task = build_task(load_config(None, [f"task.factory={path}:seek_through_data"]))
    plain, looked = DataStream(task, FaultInjector([]), torch.device("cpu")), None
    run = [plain.next(first_step=1)[0] for _ in range(10)]
    looked = DataStream(task, FaultInjector([]), torch.device("cpu"))
    seen = []
    for i in range(10):
        if i % 4 == 0:
            looked.digest()  # (a checkpoint at the step before: at a pass's end for i = 4, 8)
        seen.append(looked.next(first_step=1)[0])
    assert all(torch.equal(a, b) for a, b in zip(run, seen))


def test_a_metric_named_like_a_json_lines_records_key_is_refused_at_start_up():
    # review 52i: "loss_on" passed the factory's check, and the JSON lines sink refused it at the first
    # evaluation: exit 1 with a traceback, mid-run
    from ampguard.errors import InputError
    from ampguard.tasks.factory import check_metrics

    with pytest.raises(InputError, match=r"metric 'loss_on' is one of the CSV's fixed columns"):
        check_metrics(("val_loss", "loss_on"), "f.py:build")
