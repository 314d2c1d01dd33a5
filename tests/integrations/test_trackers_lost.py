"""A tracker that fails mid-run or at the run's end is a view lost, not the run lost (review 50f):
the training, its CSV and checkpoints go on, the run's exit code is its own, the failure is one
warning line and one ``tracker_lost`` event, and the other trackers end whole. Against the real
MLflow file store and W&B offline; the store is broken the way a disk breaks it (a folder it
writes into replaced by a file), not through a stand-in client."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from pathlib import Path

import pytest

from ampguard.records import StepLog

wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402

from ampguard.integrations import trackers  # noqa: E402
from ampguard.integrations.trackers import MLflowSink, TrackerLostWarning, WandbSink  # noqa: E402

TINY = ["task.name=charlm", "task.n_layer=1", "task.n_embd=16", "task.n_head=2", "task.block_size=16",
        "task.batch_size=4", "precision=bf16", "eval.every=0", "log.plot=false"]  # (no plot: ~0.8 CPU-s a run)


def _args(tmp_path: Path, *sets: str) -> list[str]:
    items = [*TINY, *sets, f"log.dir={tmp_path / 'runs'}", "log.name=t"]
    return ["train", *[a for item in items for a in ("--set", item)]]


def _break_store_at(monkeypatch, step: int) -> list[Path]:
    """From ``step`` on, the file the MLflow run's ``train/loss`` values go to is a folder (as a
    store gone read-only or full refuses each write): the real file store's next write fails,
    while the run's own record (its status) can still be written."""
    broken: list[Path] = []
    log = MLflowSink._log

    def breaking(self, at, row):
        if at == step and not broken:
            run = Path(self.client.get_run(self.run_id).info.artifact_uri.removeprefix("file://")).parent
            loss = run / "metrics" / "train" / "loss"
            loss.unlink()
            loss.mkdir()
            broken.append(loss)
        return log(self, at, row)

    monkeypatch.setattr(MLflowSink, "_log", breaking)
    return broken


def _mlflow_run(store: str):
    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([client.get_experiment_by_name("lost").experiment_id])
    return client, run


def _warning_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "TrackerLost" in line or "stopped taking steps" in line
            or "failed at the run's end" in line]


def test_a_store_that_fails_mid_run_loses_the_tracker_not_the_run(cli, tmp_path, monkeypatch):
    # review 50f: a read-only store stopped a 40-step run at step 6, a traceback, exit 1, no final checkpoint
    store = (tmp_path / "mlruns").as_uri()
    broken = _break_store_at(monkeypatch, 3)
    code, _, err = cli(*_args(tmp_path, "steps=6", "checkpoint.every=2", f"log.mlflow.tracking_uri={store}",
                              "log.mlflow.experiment=lost"))
    run_dir = tmp_path / "runs" / "t"
    assert broken and code == 0, err
    assert "Traceback" not in err
    [line] = _warning_lines(err)
    assert line.startswith("ampguard: warning: MLflowSink: MLflow run ") and "stopped taking steps at step 3 (" in line
    assert "the tracker run lacks step 3 and later" in line
    rows = (run_dir / "steps.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2", "3", "4", "5", "6"]  # every step trained and written
    assert (run_dir / "checkpoints" / "step-00000006.pt").exists()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    lost = [e for e in events if e["event"] == "tracker_lost"]
    assert [(e["step"], "stopped taking steps at step 3" in e["message"]) for e in lost] == [(3, True)]
    assert events[-1]["event"] == "run_end" and events[-1]["message"] == "finished: 6 steps"
    client, run = _mlflow_run(store)
    assert run.info.status == "FAILED"  # (it lacks steps: not FINISHED)


def test_one_tracker_failing_at_the_end_leaves_the_others_whole_and_the_exit_code_the_runs(cli, tmp_path, monkeypatch):
    # review 50f: W&B failing at the end left the healthy MLflow run FAILED, with no totals and no
    # artifacts, and a finished run exited 1 after a traceback while its card said "finished"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()

    def full(self, files):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(WandbSink, "_upload", full)
    store = (tmp_path / "mlruns").as_uri()
    code, _, err = cli(*_args(tmp_path, "steps=3", "log.wandb.project=lost", f"log.mlflow.tracking_uri={store}",
                              "log.mlflow.experiment=lost"))
    wandb.teardown()
    assert code == 0 and "Traceback" not in err, err
    [line] = _warning_lines(err)
    assert "WandbSink: W&B run " in line and "failed at the run's end ([Errno 28] No space left on device)" in line
    client, run = _mlflow_run(store)
    assert run.info.status == "FINISHED" and run.data.tags["ampguard.exit_code"] == "0"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"RUN.md", "steps.csv", "events.jsonl"}


def _sink(tmp_path: Path) -> MLflowSink:
    return MLflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="lost")


def _row(step: int) -> StepLog:
    return StepLog(step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def _metric_file(sink: MLflowSink, key: str) -> Path:
    run = Path(sink.client.get_run(sink.run_id).info.artifact_uri.removeprefix("file://")).parent
    return run / "metrics" / key


def _sending_sink(tmp_path: Path) -> tuple[MLflowSink, Path]:
    """An MLflow sink sending through a sender (as to a tracking server) over the real file store,
    step 1 sent and step 2 held; and the file its ``train/loss`` values go to, taken away (to
    break the store with)."""
    sink = _sink(tmp_path)
    sink._sender = trackers._Sender()
    sink.write(_row(1))
    sink.write(_row(2))  # step 1 goes out
    sink._sender.drain(30)
    loss = _metric_file(sink, "train/loss")
    loss.unlink()
    return sink, loss


@contextlib.contextmanager
def _pipes(*paths: Path):
    """Named pipes at ``paths``: a write there waits for a reader that never comes (a server that
    stopped answering); after, a thread waiting there is let go and the pipes taken away (a reader
    of the run's metrics would wait at one for a writer)."""
    for path in paths:
        os.mkfifo(path)
    try:
        yield
    finally:
        for path in paths:
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
            path.unlink()


def test_a_step_the_sender_failed_to_send_loses_the_sink_at_the_next_step_naming_that_step(tmp_path):
    # review 50f/50g: a server gone mid-run was said by MLflow's own logger once a step, its background logger
    # stalled the training when full, and the warning named a later step than the first one missing
    sink, loss = _sending_sink(tmp_path)
    loss.mkdir()  # the store refuses the next write
    sink.write(_row(3))  # step 2 goes out, and fails on the sender's thread
    with pytest.raises(trackers.NotSent):
        sink._sender.drain(30)
    with pytest.warns(TrackerLostWarning) as said:
        sink.write(_row(4))  # (raised here, at the next step)
    assert len(said) == 1 and "stopped taking steps at step 2 (step 2 was not sent: " in str(said[0].message)
    assert "the tracker run lacks step 2 and later" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the later steps and the end say nothing more
        sink.write(_row(5))
        sink.close()
    assert sink.client.get_run(sink.run_id).info.status == "FAILED"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_server_that_stops_answering_loses_the_sink_after_a_bounded_wait_and_never_holds_the_end(
        tmp_path, monkeypatch):
    # review 50g: the training sat ~4 minutes at a full background queue, and the exit waited 12 minutes more
    monkeypatch.setattr(trackers, "STALL_S", 0.3)
    monkeypatch.setattr(trackers, "END_WAIT_S", 0.3)
    sink, loss = _sending_sink(tmp_path)
    alert = loss.parents[2] / "tags" / "ampguard.last_alert"  # (and the tag an ALERT sets)
    with _pipes(loss, alert):
        started = time.monotonic()
        sink.write(_row(3))  # step 2 goes out and hangs
        from ampguard.monitor import Event, RunMonitor

        told = threading.Thread(target=sink.observe, daemon=True, args=(
            RunMonitor(), [Event(3, "skip_rate_alert", "rolling skip rate 0.5 > alert_rate 0.05")]))
        told.start()
        told.join(2.0)
        assert not told.is_alive()  # (an ALERT's tags go out behind the steps: the training's thread is not held)
        time.sleep(0.5)
        with pytest.warns(TrackerLostWarning, match=r"stopped taking steps at step 2 \(step 2 was not sent: the "
                                                    r"tracking server has not answered for 0.3 s\)"):
            sink.write(_row(4))
            sink.write(_row(5))  # (step 4 goes out: what stalled is raised)
        sink.close()
        assert time.monotonic() - started < 10


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_the_end_waits_a_bounded_time_for_steps_a_server_never_takes_and_the_run_ends_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(trackers, "END_WAIT_S", 0.3)
    sink, loss = _sending_sink(tmp_path)
    with _pipes(loss):
        sink.write(_row(3))  # step 2 goes out and hangs; step 3 is held
        with pytest.warns(TrackerLostWarning, match=r"stopped taking steps at step 2 \(the tracking server took 2 "
                                                    r"steps not in 0.3 s\)"):
            started = time.monotonic()
            sink.close()
        assert time.monotonic() - started < 10
    assert sink.client.get_run(sink.run_id).info.status == "FAILED"  # (it lacks steps: not FINISHED)


def test_a_resume_whose_store_fails_at_its_first_write_loses_the_tracker_not_the_run(cli, tmp_path, monkeypatch):
    # review 50g: the continued run's first write (its history read, a fork) ran outside the guard: a traceback
    store = (tmp_path / "mlruns").as_uri()
    sets = ["checkpoint.every=2", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=lost"]
    code, _, err = cli(*_args(tmp_path, "steps=4", *sets))
    assert code == 0, err
    history = MlflowClient.get_metric_history

    def gone(self, run_id, key):
        raise ConnectionError("Connection refused")

    monkeypatch.setattr(MlflowClient, "get_metric_history", gone)
    code, _, err = cli("train", "--resume", tmp_path / "runs" / "t", "--set", "steps=6")
    monkeypatch.setattr(MlflowClient, "get_metric_history", history)
    assert code == 0 and "Traceback" not in err, err
    [line] = _warning_lines(err)
    assert "stopped taking steps at step 5 (Connection refused)" in line


def test_a_resume_after_a_lost_tracker_says_the_steps_its_run_lacks(cli, tmp_path, monkeypatch):
    # review 50g: the next resume logged into the run with the gap and ended it FINISHED over the FAILED, unsaid
    store = (tmp_path / "mlruns").as_uri()
    sets = ["checkpoint.every=2", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=lost"]
    with monkeypatch.context() as patched:
        _break_store_at(patched, 3)
        code, _, err = cli(*_args(tmp_path, "steps=4", *sets))
    assert code == 0, err
    loss = next((tmp_path / "mlruns").rglob("metrics/train/loss"))
    loss.rmdir()  # (the store mended)
    code, _, err = cli("train", "--resume", tmp_path / "runs" / "t", "--set", "steps=6")
    assert code == 0, err
    assert "holds steps up to 2 only: steps 3 to 4 are not in it (its tracker was lost" in err


def test_a_metric_name_longer_than_mlflow_takes_is_raised_at_the_write_that_brings_it(tmp_path):
    # review 50g: it passed the name check and lost the sink when sent
    sink = _sink(tmp_path)
    with pytest.raises(ValueError, match="is 260 characters, MLflow takes at most 250"):
        sink.write(_row(1), {"x" * 255: 0.5})
    sink.close()
    assert sink.lost is None


def test_a_lost_sink_that_begins_again_calls_no_store(tmp_path):
    # review 50g: begin_again on a lost MLflow sink forked a new run nothing was ever sent to
    sink = _sink(tmp_path)
    sink.write(_row(1))
    sink._log = lambda step, row: (_ for _ in ()).throw(OSError("the store is full"))
    with pytest.warns(TrackerLostWarning):
        sink.write(_row(2))
    runs = sink.client.search_runs([sink.client.get_run(sink.run_id).info.experiment_id])
    assert sink.begin_again(0) is None
    assert len(sink.client.search_runs([runs[0].info.experiment_id])) == len(runs)
    sink.close()


def test_a_name_the_tracker_refuses_is_still_raised_at_the_write_that_brings_it(tmp_path):
    # (your metric's name is bad input, not the tracker failing: the sink is not lost)
    sink = _sink(tmp_path)
    with pytest.raises(ValueError, match=r'Invalid value "eval/acc@top1"'):
        sink.write(_row(1), {"acc@top1": 0.5})
    sink.write(_row(1), {"acc": 0.5})
    sink.close()
    assert sink.lost is None and sink.client.get_run(sink.run_id).info.status == "FINISHED"


def test_a_disabled_wandb_run_names_no_folder(tmp_path):
    # review 50f: the console's tracking line named /tmp/wandb/run-..., a folder W&B never makes
    sink = WandbSink(project="lost", mode="disabled", dir=tmp_path)
    try:
        assert sink.where.endswith("(disabled)"), sink.where
    finally:
        sink.close()


def test_a_sink_whose_server_fails_while_it_begins_again_is_lost_not_raised(tmp_path):
    # review 50l: NotSent escaped begin_again (a Hugging Face auto_find_batch_size retry ended in a traceback)
    sink, loss = _sending_sink(tmp_path)
    loss.mkdir()  # the store refuses step 2 while the abandoned attempt's steps drain
    sink.write(_row(3))
    with pytest.warns(TrackerLostWarning, match=r"stopped taking steps at step 2 \(step 2 was not sent: "):
        assert sink.begin_again(1) is None
    assert sink.lost is not None
    sink.close()


def test_a_full_queue_names_the_first_step_not_sent(monkeypatch):
    # review 50l: it named the step that found the queue full, while every step waiting was dropped too
    import threading as _threading

    monkeypatch.setattr(trackers, "MAX_QUEUED", 3)
    sender, hold = trackers._Sender(), _threading.Event()
    sender.send(1, hold.wait)  # (step 1 under way, held)
    sender.send(2, lambda: None)
    sender.send(3, lambda: None)
    with pytest.raises(trackers.NotSent, match="3 steps wait for the tracking server") as raised:
        sender.send(4, lambda: None)
    hold.set()
    assert raised.value.step == 1
