"""Review 51i: the loss-spike guard after a rollback and at its stop. A rollback emptied the
detector's window, so the spikes after it went unjudged and joined it (spikes at 5, 7 and 9: only
5 rolled back); a run stopped by a spike it could not roll back saved the spiked model as its
newest checkpoint, which ``--resume`` went on from; a window of equal losses called a loss one
rounding higher a spike."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ag, train

from ampguard.monitor import LossSpikeDetector

RUN = ["--set", "task.name=linear", "--set", "precision=bf16", "--set", "log.plot=false", "--set", "eval.enabled=false",
       "--set", "checkpoint.every=2", "--set", "rollback.triggers=[loss_spike]", "--set", "rollback.window=3",
       "--set", "rollback.skip_batches=1"]


def _events(run, kind):
    return [e for e in map(json.loads, (run / "events.jsonl").read_text().splitlines()) if e["event"] == kind]


def test_each_spike_after_a_rollback_is_judged_against_the_checkpoints_window(tmp_path):
    code, out, err = train(tmp_path, "r", *RUN, "--set", "steps=12", "--set", "rollback.max=3", "--inject", "spike@5,7,9")
    assert code == 0, err
    assert [e["step"] for e in _events(tmp_path / "r", "rollback")] == [5, 7, 9]


def test_a_spike_that_cannot_be_rolled_back_leaves_no_checkpoint_of_its_model(tmp_path):
    code, out, err = train(tmp_path, "r", *RUN, "--set", "steps=10", "--set", "rollback.max=0", "--inject", "spike@5")
    assert code == 3, err
    run = tmp_path / "r"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*.pt"))[-1] == "step-00000004.pt"
    assert "the model after it is not saved (a --resume goes on from the last checkpoint before it)" in out
    # the resume goes on from step 4 and meets the spike again, now rolled back
    code, out, err = ag("train", "--resume", run, "--set", "rollback.max=3")
    assert code == 0 and "RESUME 4" in out, err
    assert [e["step"] for e in _events(run, "rollback")] == [5]
    last = torch.load(run / "checkpoints" / "step-00000010.pt", weights_only=False)
    assert all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in last["model"].values())


@pytest.mark.parametrize("level", [0.0, 0.6931471805599453, 2.5])
def test_a_window_of_equal_losses_calls_no_rounding_a_spike(level):
    d = LossSpikeDetector(window=50, z=6.0)
    assert not any(d.check(level) for _ in range(50))
    ulp = float(torch.nextafter(torch.tensor(level), torch.tensor(10.0)))
    assert not d.check(ulp) and not d.check(level + 1e-7)
    assert d.check(level + 0.5)  # a real jump still is
