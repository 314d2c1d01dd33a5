"""Checkpoints (issue 4, part 2), the functions of ``ampguard.checkpoint``: RNG states, atomic
saves, ``latest_loadable``, listing and pruning. What a run's checkpoints hold, and ``train
--resume`` refusing code-carrying, truncated and foreign files (exit 2, one line), are in
``tests/e2e/test_checkpoint_runs.py``.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import _truncated, minimal_payload

from ampguard import checkpoint as ckpt
from ampguard.errors import InputError


# ---------------------------------------------------------------------------- rng


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    torch.rand(3), random.random(), np.random.rand(2)  # move them off their seeds
    path = ckpt.save_checkpoint(tmp_path / "step-00000001.pt", minimal_payload(1, rng=ckpt.rng_state()))
    expected = (torch.rand(4), random.random(), np.random.rand(3), np.random.randn(2))
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    ckpt.set_rng_state(ckpt.load_checkpoint(path)["rng"])
    again = (torch.rand(4), random.random(), np.random.rand(3), np.random.randn(2))
    assert torch.equal(expected[0], again[0])
    assert expected[1] == again[1]
    assert np.array_equal(expected[2], again[2]) and np.array_equal(expected[3], again[3])


# ---------------------------------------------------------------------------- atomic save


def test_save_writes_a_temp_file_in_the_same_folder_fsyncs_it_then_replaces(tmp_path, monkeypatch):
    calls: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc/self/fd") else fd))
        real_fsync(fd)

    def replace(src, dst, *, src_dir_fd=None, dst_dir_fd=None):  # (in the folder the walk holds: names relative to it)
        where = Path(os.readlink(f"/proc/self/fd/{src_dir_fd}")) if src_dir_fd is not None else Path()
        calls.append(("replace", where / src, where / dst))
        assert (where / src).stat().st_size > 0
        real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = tmp_path / "checkpoints" / "step-00000003.pt"
    assert ckpt.save_checkpoint(target, minimal_payload(3)) == target

    replaces = [c for c in calls if c[0] == "replace"]
    assert len(replaces) == 1
    _, src, dst = replaces[0]
    assert dst == target.resolve() and src.parent == target.resolve().parent
    assert src.name.startswith(".step-00000003.pt.tmp-")
    before = calls[: calls.index(replaces[0])]
    assert ("fsync", str(src)) in before  # the data is on disk before the name points at it
    assert ckpt.load_checkpoint(target)["step"] == 3
    assert os.listdir(target.parent) == [target.name]


def test_a_save_that_fails_midway_leaves_the_old_checkpoint_and_no_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "step-00000004.pt"
    ckpt.save_checkpoint(target, minimal_payload(4))
    good = target.read_bytes()

    def broken_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError):
        ckpt.save_checkpoint(target, minimal_payload(4, data_position=99))
    assert target.read_bytes() == good
    assert os.listdir(tmp_path) == [target.name]


# ---------------------------------------------------------------------------- latest_loadable, prune


def test_latest_loadable_skips_a_corrupt_newest_checkpoint(tmp_path):
    for step in (4, 8, 12):
        ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(step), minimal_payload(step))
    _truncated(tmp_path / "step-00000012.pt")
    (tmp_path / ".step-00000016.pt.tmp-123").write_bytes(b"a save killed halfway")
    (tmp_path / "notes.txt").write_text("not a checkpoint", encoding="utf-8")

    path, payload = ckpt.latest_loadable(tmp_path)
    assert path.name == "step-00000008.pt" and payload["step"] == 8
    assert torch.equal(payload["model"]["w"], torch.full((3,), 8.0))
    path, payload = ckpt.latest_loadable(tmp_path, before_step=8)
    assert path.name == "step-00000004.pt" and payload["step"] == 4
    with pytest.raises(InputError, match="from before step 4"):
        ckpt.latest_loadable(tmp_path, before_step=4)


def test_latest_loadable_says_why_when_nothing_loads(tmp_path):
    with pytest.raises(InputError, match="no checkpoint"):
        ckpt.latest_loadable(tmp_path / "missing")
    ckpt.save_checkpoint(tmp_path / "step-00000001.pt", minimal_payload(1))
    _truncated(tmp_path / "step-00000001.pt")
    with pytest.raises(InputError, match="no loadable checkpoint"):
        ckpt.latest_loadable(tmp_path)


def test_list_checkpoints_lists_finished_ones_oldest_first(tmp_path):
    for step in (10, 2, 100):
        ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(step), minimal_payload(step))
    (tmp_path / ".step-00000200.pt.tmp-7").write_bytes(b"")
    (tmp_path / "step-1.pt").write_bytes(b"")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000002.pt", "step-00000010.pt", "step-00000100.pt"]
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == [2, 10, 100]


def test_checkpoints_past_step_99_999_999_are_listed_pruned_and_resumed_in_step_order(tmp_path):
    # step 10**8's name has nine digits: it was never listed, so never pruned nor resumed from
    steps = [99_999_998, 99_999_999, 100_000_000, 100_000_001]
    for step in steps:
        ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(step), minimal_payload(step))
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == steps
    assert ckpt.latest_loadable(tmp_path)[1]["step"] == 100_000_001
    ckpt.prune(tmp_path, 2)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == steps[-2:]


def test_two_set_asides_in_the_same_second_keep_both_futures(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.time, "strftime", lambda fmt: "abandoned-20261201-120000")
    ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(1), minimal_payload(1))
    for future in ("first", "second"):
        payload = {**minimal_payload(4), "config": {"future": future}}
        ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(4), payload)
        assert [p.name for p in ckpt.set_aside_after(tmp_path, 1)] == ["step-00000004.pt"]
    kept = sorted(p for p in tmp_path.iterdir() if p.name.startswith("abandoned-"))
    assert [p.name for p in kept] == ["abandoned-20261201-120000", "abandoned-20261201-120000-2"]
    assert [ckpt.load_checkpoint(p / "step-00000004.pt")["config"]["future"] for p in kept] == ["first", "second"]


@pytest.mark.parametrize("keep", [1, 2, 5, 10])
def test_prune_keeps_the_newest_keep(tmp_path, keep):
    steps = [3, 6, 9, 12, 15]
    for step in steps:
        ckpt.save_checkpoint(tmp_path / ckpt.checkpoint_name(step), minimal_payload(step))
    (tmp_path / ".step-00000018.pt.tmp-1").write_bytes(b"")
    ckpt.prune(tmp_path, keep)
    assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path)] == steps[-keep:]
    assert (tmp_path / ".step-00000018.pt.tmp-1").exists()  # not a checkpoint: prune leaves it alone


def test_modes_kept_lets_a_models_own_train_undo_its_eval_and_keeps_a_frozen_layer_frozen():
    # review_session26: setting each flag back by hand skipped a model's train() override: an EMA model
    # whose eval() swaps in its averaged weights trained on them after the first evaluation
    from ampguard.untouched import modes_kept

    class Ema(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.BatchNorm1d(2).eval()  # frozen by the user
            self.swapped = False

        def train(self, mode: bool = True):
            if self.training and not mode:
                self.swapped = True  # (the averaged weights in)
            elif not self.training and mode:
                self.swapped = False  # (the trained weights back)
            return super().train(mode)

    model = Ema()
    model.norm.eval()
    with modes_kept(model):
        model.eval()
        assert model.swapped
    assert (model.training, model.swapped, model.norm.training) == (True, False, False)


def test_modes_kept_gives_a_frozen_layers_override_its_own_eval_again_and_calls_nothing_when_nothing_changed():
    # review_session26: calling model.train() at the exit reached a frozen EMA-like layer's train(),
    # which swapped its trained weights back, and only its flag was set back (eval, wrong weights)
    from ampguard.untouched import modes_kept

    class Swapping(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.averaged, self.calls = True, []

        def train(self, mode: bool = True):
            self.calls.append(mode)
            if mode != self.training:
                self.averaged = not mode
            return super().train(mode)

    model = torch.nn.Sequential(Swapping(), torch.nn.Linear(1, 1))
    model[0].eval()
    model[0].calls.clear()
    with modes_kept(model):
        model.eval()
    assert (model.training, model[0].training, model[0].averaged) == (True, False, True)
    with modes_kept(model):
        pass
    assert model[0].calls == [False, True, False]  # (eval, then the parent's train, then its own eval again)
