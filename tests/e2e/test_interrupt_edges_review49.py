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
    assert "Traceback" not in err, err
    # (the error torch raised as the interrupt unwound is said, not lost: review 49h)
    assert "raised while the interrupt unwound: RuntimeError: [enforce fail at inline_container.cc:672]" in err, err
    # (the checkpoint --resume takes named: the one whose save the interrupt cut is none; review 52m)
    assert ("ampguard: interrupted after step 4; 4 complete rows in runs/r/steps.csv; --resume goes on from "
            "checkpoints/step-00000002.pt") in err, err
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


RUN = [*LINEAR, "--set", "checkpoint.every=2", "--set", "log.name=r"]


def _resumed_with_a_signal(cli, monkeypatch, signum: int, *resume: object) -> tuple[int, str, str]:
    """``ampguard train --resume ...`` whose own process is sent ``signum`` once the resume has cut its
    log back to the checkpoint's step (just after its sinks are built); the handler before put back."""
    import os
    import signal

    import ampguard.trainer as trainer

    real, before = trainer.build_sinks, signal.getsignal(signum)

    def signalled(*args, **kwargs):
        sinks = real(*args, **kwargs)  # (the log cut back to the checkpoint's step)
        os.kill(os.getpid(), signum)
        return sinks

    monkeypatch.setattr(trainer, "build_sinks", signalled)
    try:
        return cli("train", "--resume", *resume)
    finally:
        signal.signal(signum, before)


def test_a_stop_signal_while_a_resume_changes_its_folder_ends_it_as_a_run_with_its_card(cli, tmp_path, monkeypatch):
    # from its log's cut on, a resume changes its folder for good (rows cut, config.yaml, the old card removed,
    # newer checkpoints set aside): a SIGTERM there unwound it as a start-up stop, leaving the cut CSV under the
    # old card (or no card at all, and the cancelled --set in config.yaml); it is noted now, and the run ends at
    # its first boundary, as a run does: run_end, a card saying so, exit 143
    import signal

    from helpers import run_events

    code, _, err = cli("train", *RUN, "--set", "steps=6")
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    code, out, err = _resumed_with_a_signal(cli, monkeypatch, signal.SIGTERM,
                                            run / "checkpoints" / "step-00000004.pt", "--set", "steps=8")
    assert code == 143, err
    assert "| ended | interrupted (SIGTERM) after step 4 |" in (run / "RUN.md").read_text()
    assert [r["step"] for r in read_rows(run / "steps.csv")] == ["1", "2", "3", "4"]
    events = run_events(run)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "run_end" and events[-1]["message"] == "interrupted (SIGTERM) after step 4"
    assert "resume" in kinds[kinds.index("run_end") + 1:]  # (the first run's end, then this resume's, then its end)
    assert not (run / "checkpoints" / "step-00000006.pt").exists()  # (set aside, as the resume said)


def test_a_stop_signal_while_resuming_a_finished_run_leaves_it_finished(cli, tmp_path, monkeypatch):
    # review 49h: the first boundary's agreement stopped it as "interrupted after step 6" over a run that had
    # trained all its 6 steps (exit 130; without the signal it ends finished, exit 0)
    import signal

    code, _, err = cli("train", *RUN, "--set", "steps=6")
    assert code == 0, err
    run = tmp_path / "runs" / "r"
    code, out, err = _resumed_with_a_signal(cli, monkeypatch, signal.SIGINT, run)
    assert code == 0, err
    assert "| ended | finished: 6 steps |" in (run / "RUN.md").read_text()


def test_a_stops_word_is_this_attempts_so_an_earlier_attempts_reads_no_later_crash(monkeypatch):
    # review 49h: torchrun keeps its rendezvous store across --max-restarts attempts; attempt 0's word of a stop
    # made attempt 1's genuine crash read "interrupted (Ctrl-C)"
    from ampguard import distributed

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = distributed._stop_key()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert distributed._stop_key() != first and "job/1" in distributed._stop_key()
