"""AmpGuardCallback's ``sinks=``, in real Hugging Face Trainers on the CPU with MLflow's file
store: each step's record with the monitor's view of it, at its step; at the end of ``train()``
the totals, the callback's files as artifacts and the tracker run ended with the exit code; the
sinks serve one ``train()``. The model is a one-layer GPT-2 (from a GPT2Config, no download)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import read_rows

transformers = pytest.importorskip("transformers")
pytest.importorskip("mlflow")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.trackers import MLflowSink, TrackerLostWarning  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


class NanLossAt(GuardedTrainer):
    """The loss of the optimizer steps in ``nan_at`` (from 1) is NaN."""

    nan_at: set[int] = set()

    def compute_loss(self, model, inputs, **kwargs):
        loss = super().compute_loss(model, inputs, **kwargs)
        return loss * float("nan") if self.state.global_step + 1 in self.nan_at else loss


def _model(trial=None):
    """The one-layer GPT-2, seeded (a search's ``model_init`` too: ``trial`` unused)."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))


def _token_ids():
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (64, 8))]


def _optuna():
    """optuna (the hyperparameter search's backend), quiet, or the test skipped."""
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def _trainer(tmp_path, callback, steps, nan_at=(), trainer_class=NanLossAt, **settings):
    model = _model()
    ids = _token_ids()
    args = TrainingArguments(str(tmp_path / "out"), **{**dict(
        per_device_train_batch_size=4, max_steps=steps, use_cpu=True, report_to=[], save_strategy="no", bf16=True,
        disable_tqdm=True), **settings})
    trainer = trainer_class(model=model, args=args, train_dataset=ids, callbacks=[callback])
    trainer.nan_at = set(nan_at)
    return trainer


def _sink(tmp_path):
    return MLflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hf")


def _history(sink, key):
    return {m.step: m.value for m in sink.client.get_metric_history(sink.run_id, key)}


def test_each_step_reaches_the_tracker_with_the_monitors_view_and_the_run_ends_with_the_files(tmp_path):
    sink = _sink(tmp_path)
    callback = AmpGuardCallback(sinks=[sink], min_steps=0, print_fn=lambda line: None)
    _trainer(tmp_path, callback, steps=4, nan_at={2}).train()
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert _history(sink, "train/skipped") == {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    assert _history(sink, "train/skip.non_finite_loss") == {1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    losses = _history(sink, "train/loss")
    assert math.isnan(losses[2]) and [losses[s] for s in (1, 3, 4)] == pytest.approx(
        [float(rows[s - 1]["loss"]) for s in (1, 3, 4)])  # the CSV's values, at the CSV's steps
    assert _history(sink, "monitor/skip_rate") == {1: 0.0, 2: 0.5, 3: pytest.approx(1 / 3), 4: 0.25}
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["ampguard.exit_code"] == "0"
    assert run.data.tags["ampguard.ended"] == "finished: 4 steps" and run.data.metrics["summary/skips"] == 1.0
    assert run.data.tags["ampguard.events.skip_rate_alert"] == "2"
    uploaded = {a.path for a in sink.client.list_artifacts(sink.run_id, "ampguard")} or {
        a.path for a in sink.client.list_artifacts(sink.run_id)}
    assert {p.rsplit("/", 1)[-1] for p in uploaded} >= {"RUN.md", "events.jsonl", "steps.csv"}, uploaded


def test_a_guard_stop_ends_the_tracker_run_failed_with_exit_code_3_and_a_later_train_is_refused_the_sinks(tmp_path):
    sink = _sink(tmp_path)
    callback = AmpGuardCallback(sinks=[sink], fail_rate=0.5, fail_after=2, min_steps=0, print_fn=lambda line: None)
    trainer = _trainer(tmp_path, callback, steps=10, nan_at=range(2, 11))
    trainer.train()
    assert trainer.state.global_step == 4 and callback.exit_code == 3  # 1/2, 2/3, 3/4: above 0.5 twice at step 4
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ampguard.exit_code"] == "3"
    assert run.data.tags["ampguard.ended"] == callback.ended and run.data.tags["ampguard.events.fail"] == "4"
    assert sorted(_history(sink, "train/skipped")) == [1, 2, 3, 4]
    rows = len(read_rows(tmp_path / "out" / "ampguard" / "steps.csv"))
    with pytest.raises(ValueError, match=r"sinks=\['MLflowSink'\] were closed when the previous train\(\)"):
        _trainer(tmp_path / "again", callback, steps=2).train()
    assert len(read_rows(tmp_path / "out" / "ampguard" / "steps.csv")) == rows  # nothing trained or written


def test_a_run_judged_at_its_end_sends_its_alert_and_failure_to_the_tracker(tmp_path):
    # a run shorter than min_steps and fail_after is judged whole at its end: its ALERT and FAIL
    # reached events.jsonl and the exit code (MLflow FAILED), but not the tracker's tags: a FAILED
    # run with no reason on the dashboard (the Lightning plugin and `ampguard train` sent them)
    sink = _sink(tmp_path)
    callback = AmpGuardCallback(sinks=[sink], fail_rate=0.2, fail_after=50, print_fn=lambda line: None)
    _trainer(tmp_path, callback, steps=4, nan_at={1, 3}).train()
    assert callback.exit_code == 3
    tags = sink.client.get_run(sink.run_id).data.tags
    assert tags["ampguard.events.skip_rate_alert"] == "4" and tags["ampguard.events.fail"] == "4"
    assert tags["ampguard.last_alert"].startswith("step 4: skip rate above fail_rate 0.2 at every one of the run's 4 steps")


def test_a_crash_in_train_ends_the_tracker_run_failed_with_its_steps(tmp_path):
    class CrashAt3(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            if self.state.global_step + 1 == 3:
                raise RuntimeError("boom")
            return super().compute_loss(model, inputs, **kwargs)

    sink = _sink(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=5,
                 trainer_class=CrashAt3).train()
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ampguard.exit_code"] == "1"
    assert run.data.tags["ampguard.ended"] == "crashed after step 2: RuntimeError: boom"
    assert sorted(_history(sink, "train/skipped")) == [1, 2]


def test_a_stock_trainer_sends_what_the_callback_watches(tmp_path):
    sink = _sink(tmp_path)
    with pytest.warns(UserWarning, match="watch"):
        _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=3,
                 trainer_class=Trainer).train()
    assert _history(sink, "train/skipped") == {1: 0.0, 2: 0.0, 3: 0.0}
    assert sorted(_history(sink, "train/grad_l2_post_clip")) == [1, 2, 3]
    assert sink.client.get_run(sink.run_id).info.status == "FINISHED"


class CrashAt3(GuardedTrainer):
    def compute_loss(self, model, inputs, **kwargs):
        if self.state.global_step + 1 == 3:
            raise self.error
        return super().compute_loss(model, inputs, **kwargs)


class StockCrashAt3(Trainer):
    def compute_loss(self, model, inputs, **kwargs):
        if self.state.global_step + 1 == 3 and self.crash:
            raise RuntimeError("boom")
        return super().compute_loss(model, inputs, **kwargs)


class UploadFails(MLflowSink):
    def _upload(self, files):
        raise OSError("the artifact store is unreachable")


class CloseFails(MLflowSink):
    def close(self):
        super().close()
        raise OSError("the sink cannot close")


@pytest.mark.parametrize("error, code", [(RuntimeError("boom"), "1"), (KeyboardInterrupt(), "130")])
def test_a_crash_stays_trains_own_error_when_a_sink_fails_to_close(tmp_path, error, code):
    sink = CloseFails(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hf")
    trainer = _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=5,
                       trainer_class=CrashAt3)
    trainer.error = error
    with pytest.raises(type(error)) as raised:
        trainer.train()
    assert raised.value is error  # (not the sink's OSError: a Ctrl-C still exits 130)
    assert raised.value.__notes__ == ["ampguard: ending the callback's files or sinks raised too: "
                                      "OSError('the sink cannot close')"]
    assert sink.client.get_run(sink.run_id).data.tags["ampguard.exit_code"] == code


def test_a_failed_upload_still_ends_the_tracker_run_with_the_outcome(tmp_path):
    # (said once; the train() the tracker watched is not failed by it: review 50f)
    sink = UploadFails(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hf")
    with pytest.warns(TrackerLostWarning, match=r"failed at the run's end \(the artifact store is unreachable\)"):
        _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=2).train()
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["ampguard.exit_code"] == "0"  # (ended, not RUNNING)
    assert sorted(_history(sink, "train/skipped")) == [1, 2]


class LogFailsFrom3(MLflowSink):
    def _log(self, step, row):
        if step >= 3:
            raise OSError(28, "No space left on device")
        return super()._log(step, row)


def test_a_tracker_lost_mid_train_is_a_tracker_lost_event_in_the_callbacks_log(tmp_path):
    # review 50g: outside ampguard train the loss left no record but the warning
    sink = LogFailsFrom3(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hf")
    with pytest.warns(TrackerLostWarning, match="stopped taking steps at step 3"):
        _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=5).train()
    events = [json.loads(line) for line in (tmp_path / "out" / "ampguard" / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "tracker_lost"]
    assert len(lost) == 1 and "stopped taking steps at step 3" in lost[0]["message"] and lost[0]["step"] >= 3
    assert sorted(_history(sink, "train/skipped")) == [1, 2]


def test_a_resume_refused_its_closed_sinks_leaves_no_resume_behind_for_the_next_train(tmp_path):
    callback = AmpGuardCallback(sinks=[_sink(tmp_path)], print_fn=lambda line: None)
    _trainer(tmp_path, callback, steps=4, save_strategy="steps", save_steps=2).train()
    csv = tmp_path / "out" / "ampguard" / "steps.csv"
    with pytest.raises(ValueError, match="were closed when the previous train"):
        _trainer(tmp_path, callback, steps=4).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    callback.sinks = [_sink(tmp_path)]
    with pytest.raises(Exception, match="already exists"):  # a fresh run: refused, as any fresh run on that CSV
        _trainer(tmp_path, callback, steps=4).train()
    assert [r["step"] for r in read_rows(csv)] == ["1", "2", "3", "4"]  # (the refused resume cut nothing)


def _crashed(tmp_path, old):
    """A stock Trainer whose ``train()`` raised at step 3 with ``old`` among its callback's sinks."""
    callback = AmpGuardCallback(tmp_path / "guard", sinks=[old], print_fn=lambda line: None)
    trainer = _trainer(tmp_path, callback, steps=4, trainer_class=StockCrashAt3)
    trainer.crash = True
    with pytest.warns(UserWarning, match="watch"), pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    return trainer, callback


def _train_again(tmp_path, trainer, callback):
    """The crashed ``trainer``'s next ``train()``, with a new sink: (the sink, the warnings said)."""
    new = _sink(tmp_path)
    callback.sinks = [new]
    (tmp_path / "guard" / "steps.csv").unlink()  # (a fresh run refuses the old CSV)
    trainer.crash = False
    with pytest.warns(UserWarning, match="watch") as said:
        trainer.train()
    return new, [str(w.message) for w in said]


def test_a_stock_trainers_crash_ends_its_sinks_failed_at_the_next_train(tmp_path):
    old = _sink(tmp_path)
    trainer, callback = _crashed(tmp_path, old)
    assert old.client.get_run(old.run_id).info.status == "RUNNING"  # (a callback is not told of the error)
    new, _ = _train_again(tmp_path, trainer, callback)
    run = old.client.get_run(old.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ampguard.exit_code"] == "1"
    assert run.data.tags["ampguard.ended"] == "ended after step 2 by an error the callback was not told of (train() raised)"
    assert sorted(_history(old, "train/skipped")) == [1, 2]  # (nothing of the next train() in the old run)
    assert sorted(_history(new, "train/skipped")) == [1, 2, 3, 4]


def test_a_crashed_trains_sink_that_fails_to_end_at_the_next_train_is_a_warning_and_the_train_goes_on(tmp_path):
    old = CloseFails(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hf")
    new, said = _train_again(tmp_path, *_crashed(tmp_path, old))
    assert [message for message in said if "previous train()" in message] == [
        "AmpGuardCallback: ending the previous train()'s sinks raised: OSError('the sink cannot close')"]
    assert old.client.get_run(old.run_id).info.status == "FAILED"  # (ended before its close raised)
    assert sorted(_history(new, "train/skipped")) == [1, 2, 3, 4]  # this train() went on, its sink served
    assert new.client.get_run(new.run_id).info.status == "FINISHED"


def test_a_process_other_than_0_writes_no_row_and_ends_its_tracker_run_saying_why(tmp_path):
    # (review 48b: sinks built on every process left one empty run a process, ended at exit "a start that
    # was refused, or a sink never written")
    class NotZero(NanLossAt):
        def is_world_process_zero(self):
            return False

    sink = _sink(tmp_path)
    with pytest.warns(AmpguardWarning, match=r"^AmpGuardCallback: 1 tracker sink\(s\) given to process \d+ were ended "
                                             r"unused: only process 0 logs"):
        _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=2,
                 trainer_class=NotZero).train()
    assert _history(sink, "train/skipped") == {}
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ampguard.ended"].startswith("this sink logged no step: it was given to process ")


def test_the_callbacks_files_are_the_artifacts_a_retrys_rows_among_them(tmp_path):
    from ampguard.integrations.trackers import Outcome
    from ampguard.monitor import RunMonitor

    folder = tmp_path / "ampguard"
    folder.mkdir()
    for name in ("steps.csv", "steps.attempt-1.csv", "events.jsonl", "summary.json", "RUN.md", "notes.txt"):
        (folder / name).write_text("x\n", encoding="utf-8")
    sink = _sink(tmp_path)
    sink.finish(Outcome(RunMonitor(), 0, "finished: 2 steps", folder))
    uploaded = {a.path.rsplit("/", 1)[-1] for top in sink.client.list_artifacts(sink.run_id)
                for a in ([top] if not top.is_dir else sink.client.list_artifacts(sink.run_id, top.path))}
    assert uploaded == {"steps.csv", "steps.attempt-1.csv", "events.jsonl", "summary.json", "RUN.md"}


def _in_order(pairs, expected):
    """Whether ``(step, value)`` pairs are ``expected``'s items, in order, one a step."""
    return [step for step, _ in pairs] == list(expected) and [v for _, v in pairs] == pytest.approx(list(expected.values()))


def test_after_an_auto_find_batch_size_retry_each_sink_holds_the_new_attempts_steps_once(tmp_path, monkeypatch):
    # HF begins the loop again with a smaller batch after an out-of-memory at step 3: the sinks
    # had the abandoned attempt's steps 1-2. The CSV moves them aside; so does each sink, as it can
    import glob
    import json
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ampguard.integrations.trackers import ForkedRunWarning, WandbSink
    from ampguard.sinks import CsvSink, JsonlSink, TensorBoardSink

    wandb = pytest.importorskip("wandb")
    from test_trackers import wandb_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # (a W&B set up earlier in this process keeps its settings)
    mlflow, jsonl = _sink(tmp_path), JsonlSink(tmp_path / "steps.jsonl")
    sinks = [mlflow, WandbSink(project="hf", mode="offline", dir=tmp_path), TensorBoardSink(tmp_path / "tb"), jsonl,
             CsvSink(tmp_path / "mine.csv")]  # (its steps must increase: it refused the retry's step 1, ending train())
    first = mlflow.run_id
    trainer = _trainer(tmp_path, AmpGuardCallback(sinks=sinks, print_fn=lambda line: None), steps=4,
                       auto_find_batch_size=True)
    forwards = [0]

    def out_of_memory(module, args, kwargs):
        forwards[0] += 1
        if kwargs["input_ids"].shape[0] > 2 and forwards[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB (a stand-in)")

    trainer.model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    with pytest.warns(ForkedRunWarning, match=f"MLflow run {first} already holds step 1: continuing in a new run"):
        trainer.train()
    wandb.teardown()  # (W&B's service completes the run file)
    assert (trainer.state.global_step, trainer.state.train_batch_size) == (4, 2)
    folder = tmp_path / "out" / "ampguard"
    loss = lambda path: {int(row["step"]): float(row["loss"]) for row in read_rows(path)}  # noqa: E731
    kept, aside = loss(folder / "steps.csv"), loss(folder / "steps.attempt-1.csv")
    assert sorted(kept) == [1, 2, 3, 4] and sorted(aside) == [1, 2] and kept[1] != aside[1]
    retry, again = [e for e in map(json.loads, (folder / "events.jsonl").read_text().splitlines())
                    if e["event"] == "retry"]  # (HF tries a batch of 3, then 2)
    assert retry["message"].endswith(
        f"; its 2 rows moved to steps.attempt-1.csv; the LR schedule and the monitor start afresh; MLflow run {first} "
        f"keeps the abandoned attempt's steps 1-2 and ends FAILED: this attempt goes on in a new run {mlflow.run_id} "
        f"(the history through step 0); W&B run {sinks[1].run.id} keeps the abandoned attempt's steps 1-2 (W&B cannot "
        "rewrite a logged step): this attempt's go there from step 3; TensorBoard drops the abandoned attempt's steps "
        "1-2 (a restart marker at step 1); steps.jsonl's 2 rows after it moved to steps.attempt-1.jsonl; mine.csv's 2 rows "
        "after it moved to mine.attempt-1.csv")
    assert again["message"].endswith("start afresh")  # (the attempt of batch 3 sent no step: no sink had any to set aside)
    # MLflow: the new run holds the CSV's steps once; the old one the abandoned attempt's, ended FAILED
    assert _in_order([(m.step, m.value) for m in mlflow.client.get_metric_history(mlflow.run_id, "train/loss")],
                     kept)  # (one value a step: a second, the abandoned attempt's, would be there too)
    new = mlflow.client.get_run(mlflow.run_id)
    assert new.info.status == "FINISHED" and new.data.tags["ampguard.resumed_from"] == first
    old = mlflow.client.get_run(first)
    assert old.info.status == "FAILED" and old.data.tags["ampguard.superseded_by"] == mlflow.run_id
    assert {m.step: m.value for m in mlflow.client.get_metric_history(first, "train/loss")} == pytest.approx(aside)
    # the line files: as the callback's CSV
    assert loss(tmp_path / "mine.csv") == kept and loss(tmp_path / "mine.attempt-1.csv") == aside
    steps = lambda path: [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]  # noqa: E731
    assert _in_order(steps(tmp_path / "steps.jsonl"), kept) and _in_order(steps(tmp_path / "steps.attempt-1.jsonl"), aside)
    # TensorBoard: the abandoned steps dropped by the marker
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert _in_order([(e.step, e.value) for e in events.Scalars("train/loss")], kept)
    # W&B keeps what it holds: the abandoned attempt's steps 1-2, then this attempt's
    (logged,) = [wandb_run(Path(p)) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))]
    assert {step: row["train/loss"] for step, row in logged.history.items()} == pytest.approx({**kept, **aside})
    assert logged.exit_code == 0


def test_a_wandb_sink_beside_hfs_own_wandb_reporting_keeps_a_run_of_its_own(tmp_path, monkeypatch):
    # the sink made first (as sinks=[...] is, before the Trainer): HF's WandbCallback's wandb.init()
    # got the sink's run back (W&B returns the most recent active run) and train() died at its
    # start in wandb.config.update ("You must call wandb.init() before")
    import glob
    from pathlib import Path

    from ampguard.integrations.trackers import WandbSink

    wandb = pytest.importorskip("wandb")
    from test_trackers import wandb_run

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    wandb.teardown()  # (a W&B set up earlier in this process keeps its settings)
    sink = WandbSink(project="sink", mode="offline", dir=tmp_path)
    callback = AmpGuardCallback(sinks=[sink], print_fn=lambda line: None)
    trainer = _trainer(tmp_path, callback, steps=3, nan_at={2}, report_to=["wandb"], logging_steps=1)
    trainer.train()
    wandb.finish()  # (HF leaves its run open)
    wandb.teardown()
    runs = {r.id: r for r in (wandb_run(Path(p)) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb")))}
    assert len(runs) == 2 and sink.run.id in runs
    ours, hf = runs.pop(sink.run.id), runs.popitem()[1]
    assert {step: row["train/skipped"] for step, row in ours.history.items()} == {1: 0, 2: 1, 3: 0}
    # HF's run holds HF's log, the guard's keys among them (GuardedTrainer.log), none of the sink's rows
    assert [row.get("train/ampguard/skipped") for row in hf.history.values() if "train/loss" in row] == [0, 1, 0]
    assert not any("train/skip.non_finite_loss" in row for row in hf.history.values())


def test_a_full_disk_at_the_end_still_ends_the_sinks(tmp_path, monkeypatch):
    import errno

    from ampguard.sinks import CsvSink

    closing = CsvSink.close

    def full(self):
        closing(self)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(CsvSink, "close", full)
    sink = _sink(tmp_path)
    trainer = _trainer(tmp_path, AmpGuardCallback(sinks=[sink], print_fn=lambda line: None), steps=5,
                       trainer_class=CrashAt3)
    trainer.error = RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom") as raised:
        trainer.train()
    assert "No space left on device" in raised.value.__notes__[0]
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ampguard.exit_code"] == "1"  # (ended, not RUNNING)


def test_a_stock_train_refused_for_its_csv_does_not_use_up_the_next_ones_sinks(tmp_path):
    callback = AmpGuardCallback(tmp_path / "guard", sinks=[_sink(tmp_path)], print_fn=lambda line: None)
    trainer = _trainer(tmp_path, callback, steps=2, trainer_class=StockCrashAt3)
    trainer.crash = False
    with pytest.warns(UserWarning, match="watch"):
        trainer.train()
    callback.sinks = [sink := _sink(tmp_path)]
    with pytest.warns(UserWarning, match="watch"), pytest.raises(Exception, match="already exists"):
        trainer.train()  # (refused before a step: steps.csv is the first train()'s)
    (tmp_path / "guard" / "steps.csv").unlink()
    (tmp_path / "guard" / "events.jsonl").unlink()
    with pytest.warns(UserWarning, match="watch"):
        trainer.train()  # (the refused train() served nothing: these sinks are this one's)
    assert sink.client.get_run(sink.run_id).info.status == "FINISHED" and sorted(_history(sink, "train/skipped")) == [1, 2]


def test_sinks_given_on_a_process_other_than_0_are_refused_to_a_later_train_there_too(tmp_path):
    class NotZero(NanLossAt):
        def is_world_process_zero(self):
            return False

    sink = _sink(tmp_path)
    callback = AmpGuardCallback(sinks=[sink], print_fn=lambda line: None)
    _trainer(tmp_path, callback, steps=1, trainer_class=NotZero).train()
    with pytest.raises(ValueError, match="were closed when the previous train"):  # (as on process 0: every rank alike)
        _trainer(tmp_path / "again", callback, steps=1, trainer_class=NotZero).train()
    sink.close()


@pytest.mark.parametrize("trainer_class, hp_name", [
    ("GuardedTrainer", None), ("GuardedTrainer", "lr/{}"), ("Trainer + callback", None), ("Trainer + callback", "lr/{}")])
def test_each_trial_of_a_hyperparameter_search_has_its_own_files_and_tracker_run(tmp_path, trainer_class, hp_name):
    # every trial is a train() with the same callback: the second refused the first's steps.csv
    # ("already exists") and its closed sinks, so a search with the callback failed at trial 2.
    # The trial's folder is HF's name for its run folder (GuardedTrainer: run-<trial number>; a
    # stock Trainer does not say: the first free run-<N>), or hp_name's (one folder, both alike)
    import contextlib
    import json

    _optuna()
    made = []

    def sinks(state):  # each trial its own tracker run, named and with its parameters
        made.append(MLflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="hpo",
                               run_name=f"trial {len(made)}", params=state.trial_params))
        return made[-1:]

    ids = _token_ids()
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                             report_to=[], save_strategy="no", bf16=True, disable_tqdm=True)
    callback = AmpGuardCallback(sinks=sinks, min_steps=0, print_fn=lambda line: None)
    settings = dict(model_init=_model, args=args, train_dataset=ids, eval_dataset=ids[:8], callbacks=[callback])
    guarded = trainer_class == "GuardedTrainer"
    trainer = NanLossAt(**settings) if guarded else Trainer(**settings)
    trainer.nan_at = {2}  # (GuardedTrainer's step 2 is a skip; the stock one only watches)
    space = lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)}  # noqa: E731
    with contextlib.nullcontext() if guarded else pytest.warns(UserWarning, match="watch"):
        trainer.hyperparameter_search(hp_space=space, backend="optuna", n_trials=2, direction="minimize",
                                      hp_name=hp_name and (lambda trial: hp_name.format(trial.number)))
    folders = sorted((tmp_path / "out" / "ampguard").iterdir())
    assert [f.name for f in folders] == (["lr_0", "lr_1"] if hp_name else ["run-0", "run-1"])
    for folder, sink in zip(folders, made, strict=True):
        rows = read_rows(folder / "steps.csv")
        run = sink.client.get_run(sink.run_id)
        assert [r["step"] for r in rows] == ["1", "2", "3"] and float(rows[0]["lr"]) == pytest.approx(
            float(run.data.params["learning_rate"]))  # (this trial's learning rate, in its own files)
        if guarded:
            assert [r["skip_reason"] for r in rows] == ["", "non_finite_loss", ""]
        assert json.loads((folder / "summary.json").read_text())["steps"] == 3
        assert run.info.status == "FINISHED" and sorted(_history(sink, "train/skipped")) == [1, 2, 3]
    with contextlib.nullcontext() if guarded else pytest.warns(UserWarning, match="watch"):
        trainer.train()  # (the best trial's settings, trained for good: not a trial, the callback's own folder)
    assert [r["step"] for r in read_rows(tmp_path / "out" / "ampguard" / "steps.csv")] == ["1", "2", "3"]


def test_a_pruned_trial_and_a_train_a_callback_stopped_say_so_and_end_their_runs_finished(tmp_path):
    # HF calls on_train_end before it raises optuna.TrialPruned: the summary said "finished" of a
    # train() the search had pruned (GuardedTrainer knows, at the last step too), as of one a
    # callback had stopped at step 2 of 3
    import json

    from transformers import TrainerCallback

    optuna = _optuna()

    class AlwaysPrune(optuna.pruners.BasePruner):
        def prune(self, study, trial):
            return True

    class StopAt2(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 2

    ids = _token_ids()
    for case, sink in (("pruned", _sink(tmp_path)), ("stopped", _sink(tmp_path))):
        callback = AmpGuardCallback(tmp_path / case, sinks=lambda state, sink=sink: [sink], print_fn=lambda line: None)
        args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, use_cpu=True,
                                 report_to=[], save_strategy="no", bf16=True, disable_tqdm=True,
                                 eval_strategy="steps", eval_steps=3 if case == "pruned" else 2)
        trainer = GuardedTrainer(model_init=_model, args=args, train_dataset=ids, eval_dataset=ids[:8],
                                 callbacks=[callback] + ([StopAt2()] if case == "stopped" else []))
        if case == "pruned":
            space = lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2)}  # noqa: E731
            with pytest.raises(ValueError, match="No trials are completed"):  # (optuna: no best trial to give)
                trainer.hyperparameter_search(hp_space=space, backend="optuna", n_trials=1, pruner=AlwaysPrune())
            summary = json.loads((tmp_path / case / "run-0" / "summary.json").read_text())
            ended = "pruned by the hyperparameter search after step 3 of 3"  # (at the last: as if it had finished)
        else:
            trainer.train()
            summary = json.loads((tmp_path / case / "summary.json").read_text())
            ended = "stopped after step 2 of 3: a callback asked (control.should_training_stop)"
        run = sink.client.get_run(sink.run_id)
        assert (summary["ended"], summary["exit_code"], summary["steps"]) == (ended, 0, 3 if case == "pruned" else 2)
        assert run.info.status == "FINISHED" and run.data.tags["ampguard.ended"] == ended
