"""Review 49f: stops at a run's edges. A second Ctrl-C inside ``torch.save`` comes out as the zip
writer's own ``RuntimeError ... unexpected pos``, raised while the KeyboardInterrupt unwound (its
``__context__``): the run read it as a crash (exit 1, a traceback, "crashed after step 2" on the
card; under torchrun both ranks exit 1, the peer with "Connection closed by peer")."""
from __future__ import annotations

import torch

import ampguard.checkpoint as checkpoint
from helpers import read_rows

LINEAR = ["--set", "task.name=linear", "--set", "precision=bf16", "--set", "eval.enabled=false",
          "--set", "log.plot=false"]


def test_a_ctrl_c_that_torch_save_wraps_in_its_own_error_is_an_interrupt_not_a_crash(cli, tmp_path, monkeypatch):
    real, calls = torch.save, []

    def interrupted_save(obj, f, *args, **kwargs):  # (what the zip writer does when a Ctrl-C lands in it)
        calls.append(1)
        if len(calls) == 2:  # (step 4's save: step 2's is whole)
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 80038272 vs 80038164")
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", interrupted_save)
    code, out, err = cli("train", *LINEAR, "--set", "steps=6", "--set", "checkpoint.every=2", "--set", "log.name=r")
    assert code == 130, err
    assert "Traceback" not in err and "RuntimeError" not in err, err
    assert "interrupted after step 4; 4 complete rows" in err, err
    run = tmp_path / "runs" / "r"
    assert "| ended | interrupted (Ctrl-C) after step 4 |" in (run / "RUN.md").read_text()
    assert [r["step"] for r in read_rows(run / "steps.csv")] == ["1", "2", "3", "4"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002.pt"]  # (no partial file left)


def test_a_ctrl_c_during_an_evaluation_leaves_the_row_of_the_step_the_model_took(cli, tmp_path, monkeypatch):
    # the evaluation runs after the step's update, before its record is queued: a second Ctrl-C there lost
    # the row of a step the model took (README: "every step the model took still has its row")
    from ampguard.evaluation import Evaluator

    real, calls = Evaluator.__call__, []

    def interrupted(self):
        calls.append(1)
        if len(calls) == 2:  # (step 4's evaluation: step 2's is whole)
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Evaluator, "__call__", interrupted)
    code, out, err = cli("train", "--set", "task.name=linear", "--set", "precision=bf16", "--set", "log.plot=false",
                         "--set", "steps=6", "--set", "eval.every=2", "--set", "log.name=r")
    assert code == 130, err
    run = tmp_path / "runs" / "r"
    rows = read_rows(run / "steps.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert rows[1]["val_loss"] != "" and rows[3]["val_loss"] == ""  # (step 4's metrics were not finished)
    assert "| ended | interrupted (Ctrl-C) after step 4 |" in (run / "RUN.md").read_text()
