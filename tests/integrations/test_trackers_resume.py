"""A resume from a checkpoint older than the MLflow run's last step (a crash after the last
checkpoint, or ``--resume`` of an older one) replays steps the run already holds. MLflow cannot
delete a logged value, so the sink forks: a new MLflow run with the history up to the
checkpoint's step, one value per step as in the CSV; the old run kept, marked superseded.
Against MLflow's real file store, read back through ``MlflowClient``."""

from __future__ import annotations

import pytest

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient  # noqa: E402
from test_trackers import NUMBERS, cell, read_csv, same  # noqa: E402 - the CSV/tracker comparison helpers

from ampguard.cli import main  # noqa: E402
from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.trackers import ForkedRunWarning, MLflowSink  # noqa: E402
from ampguard.records import StepLog  # noqa: E402

# the tags, as the README names them
RUN_ID_TAG, RESUMED_FROM_TAG, RESUMED_AT_TAG = "ampguard.run_id", "ampguard.resumed_from", "ampguard.resumed_at"
SUPERSEDED_BY_TAG = "ampguard.superseded_by"


def steps_of(client, run_id, key="train/loss"):
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_resume_from_an_older_checkpoint_forks_the_mlflow_run_so_each_step_has_one_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = (tmp_path / "mlruns").as_uri()
    sets = ["task.name=linear", "precision=bf16", "device=cpu", "steps=4", "checkpoint.every=2", "log.plot=false",
            f"log.dir={tmp_path / 'runs'}", "log.name=t", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=x"]
    assert main(["train"] + [a for item in sets for a in ("--set", item)]) == 0
    run_dir = tmp_path / "runs" / "t"
    first_csv = read_csv(run_dir / "steps.csv")
    # steps 3-4 trained again from the step-2 checkpoint (the trainer sets the step-4 one aside)
    assert main(["train", "--resume", str(run_dir / "checkpoints" / "step-00000002.pt"), "--set", "steps=6"]) == 0
    csv = read_csv(run_dir / "steps.csv")
    assert [r["step"] for r in csv] == ["1", "2", "3", "4", "5", "6"] and csv[3]["loss"] != first_csv[3]["loss"]

    client = MlflowClient(tracking_uri=store)
    new, old = client.search_runs([client.get_experiment_by_name("x").experiment_id],
                                  order_by=["attributes.start_time DESC"])
    for name in NUMBERS:  # one value per step, the CSV's, in the run the resume logged to
        logged = client.get_metric_history(new.info.run_id, f"train/{name}")
        assert sorted(m.step for m in logged) == [1, 2, 3, 4, 5, 6], name
        values = {m.step: m.value for m in logged}
        assert all(same(values.get(int(r["step"])), cell(r[name])) for r in csv), name
    assert steps_of(client, new.info.run_id, "monitor/skip_rate") == [1, 2, 3, 4, 5, 6]
    old_loss = {m.step: m.value for m in client.get_metric_history(old.info.run_id, "train/loss")}
    assert old_loss == {int(r["step"]): float(r["loss"]) for r in first_csv}  # the old run as it was
    run_id = (run_dir / "run-id").read_text().strip()
    assert new.data.tags[RUN_ID_TAG] == old.data.tags[RUN_ID_TAG] == run_id
    assert (new.data.tags[RESUMED_FROM_TAG], new.data.tags[RESUMED_AT_TAG]) == (old.info.run_id, "2")
    assert old.data.tags[SUPERSEDED_BY_TAG] == new.info.run_id and RESUMED_FROM_TAG not in old.data.tags
    assert new.info.status == old.info.status == "FINISHED" and new.info.run_name == old.info.run_name == "t"
    assert new.data.params == old.data.params and new.data.params["steps"] == "4"  # the run's first config
    assert new.data.tags["ampguard.steps"] == "6" and old.data.tags["ampguard.steps"] == "4"

    # the next resume (the folder's newest checkpoint, step 6) continues the newest run: no fork
    assert main(["train", "--resume", str(run_dir), "--set", "steps=7"]) == 0
    runs = client.search_runs([client.get_experiment_by_name("x").experiment_id])
    assert len(runs) == 2 and steps_of(client, new.info.run_id) == [1, 2, 3, 4, 5, 6, 7]


def step(n):
    return StepLog(n, lr=0.1, loss=float(n), grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0)


def test_a_sink_continuing_a_run_by_its_id_forks_only_when_the_steps_are_there(tmp_path):
    """In your own loop (``MLflowSink(run_id=...)``): writing step 3 again into a run that holds
    1-3 forks (``sink.run_id`` is the new run's); writing the step after the last does not."""
    uri = (tmp_path / "mlruns").as_uri()
    first = MLflowSink(tracking_uri=uri, experiment="own")
    for n in (1, 2, 3):
        first.write(step(n))
    first.close()
    again = MLflowSink(tracking_uri=uri, run_id=first.run_id)
    with pytest.warns(ForkedRunWarning, match=rf"^MLflow run {first.run_id} already holds step 3: continuing in a "
                                              r"new run \w+ \(its history through step 2;"):
        again.write(step(3))  # (a loop that named run_id= is told it writes elsewhere now)
    again.close()
    client = first.client
    assert again.run_id != first.run_id
    assert {m.step: m.value for m in client.get_metric_history(again.run_id, "train/loss")} == {1: 1.0, 2: 2.0, 3: 3.0}
    assert steps_of(client, first.run_id) == [1, 2, 3]
    assert client.get_run(first.run_id).data.tags[SUPERSEDED_BY_TAG] == again.run_id
    on = MLflowSink(tracking_uri=uri, run_id=again.run_id)
    on.write(step(4))
    on.close()
    assert on.run_id == again.run_id and steps_of(client, again.run_id) == [1, 2, 3, 4]


def test_a_loop_that_begins_again_forks_the_run_at_its_step_and_ends_the_old_one_failed(tmp_path):
    """``begin_again(step)`` (what ``AmpGuardCallback`` calls at a Hugging Face retry): the steps
    sent after ``step``, the one still held back included, stay in the old run, ended FAILED; the
    new run holds the history through ``step`` and the steps written next. Nothing sent after the
    step: no fork."""
    sink = MLflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="own")
    for n in (1, 2, 3):
        sink.write(step(n))  # (3 is held back until the next write or a flush)
    assert sink.begin_again(3) is None
    first = sink.run_id
    with pytest.warns(ForkedRunWarning, match=rf"^MLflow run {first} already holds step 2"):
        said = sink.begin_again(1)
    assert said == (f"MLflow run {first} keeps the abandoned attempt's steps 2-3 and ends FAILED: this attempt goes "
                    f"on in a new run {sink.run_id} (the history through step 1)")
    for n in (2, 3):
        sink.write(StepLog(n, lr=0.1, loss=10.0 * n, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
    sink.close()
    client = sink.client
    assert {m.step: m.value for m in client.get_metric_history(sink.run_id, "train/loss")} == {1: 1.0, 2: 20.0, 3: 30.0}
    assert {m.step: m.value for m in client.get_metric_history(first, "train/loss")} == {1: 1.0, 2: 2.0, 3: 3.0}
    old, new = client.get_run(first), client.get_run(sink.run_id)
    assert old.info.status == "FAILED" and old.data.tags[SUPERSEDED_BY_TAG] == sink.run_id
    assert new.info.status == "FINISHED" and new.data.tags[RESUMED_AT_TAG] == "1"


def test_a_run_refused_after_its_tracker_opened_ends_the_mlflow_run_failed(tmp_path, monkeypatch):
    # the tracker sinks open first (a store that refuses does so before a resume cuts a log); a
    # file sink refused after them left the MLflow run RUNNING until the process exited
    from ampguard.errors import InputError

    monkeypatch.chdir(tmp_path)
    store = (tmp_path / "mlruns").as_uri()

    def refuse(*args, **kwargs):
        raise InputError("steps.jsonl: refused")

    monkeypatch.setattr("ampguard.build.JsonlSink", refuse)
    sets = ["task.name=linear", "precision=bf16", "device=cpu", "steps=2", "log.jsonl=true",
            f"log.dir={tmp_path / 'runs'}", "log.name=t", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=x"]
    assert main(["train"] + [a for item in sets for a in ("--set", item)]) == 2
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("x").experiment_id])
    assert run.info.status == "FAILED"


def _r1(uri: str) -> MLflowSink:
    """A sink of ampguard run ``R1`` (experiment ``k``): the run found by its tag, as a resume finds it."""
    return MLflowSink(tracking_uri=uri, experiment="k", ampguard_run_id="R1")


def _logged(uri: str, steps: int) -> MLflowSink:
    """A closed sink of run ``R1`` (experiment ``k``) that logged steps 1..``steps``."""
    sink = _r1(uri)
    for n in range(1, steps + 1):
        sink.write(step(n))
    sink.close()
    return sink


class Killed(BaseException):
    """A kill, where the fork was: nothing after it runs (BaseException: no handler takes it)."""


def fails_when(monkeypatch, owner, name: str, when, error: BaseException) -> None:
    """``owner.name`` raises ``error`` for a call ``when(*args, **kwargs)`` is true of."""
    real = getattr(owner, name)

    def failing(*args, **kwargs):
        if when(*args, **kwargs):
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def test_a_fork_a_kill_cuts_short_is_never_continued_and_the_next_fork_holds_the_whole_history(tmp_path, monkeypatch):
    # the fork was tagged ampguard.run_id before its history was copied: a kill in the copy left a
    # run the next resume continued (steps 301-600 of 600, the rest never copied) and the old run
    # RUNNING for ever
    uri = (tmp_path / "mlruns").as_uri()
    first = _logged(uri, 4)
    client = first.client

    cut = _r1(uri)  # a resume from step 2's checkpoint
    fails_when(monkeypatch, cut.client, "log_batch", lambda run_id, metrics=(), **_: bool(metrics), Killed())  # (the copy)
    with pytest.raises(Killed):
        cut.write(step(3))
    monkeypatch.undo()
    [incomplete] = [r for r in client.search_runs([client.get_experiment_by_name("k").experiment_id])
                    if r.info.run_id != first.run_id]
    assert RUN_ID_TAG not in incomplete.data.tags  # (not found by a resume)

    again = _r1(uri)
    assert again.run_id == first.run_id  # the old run, its history whole, is the one continued
    with pytest.warns(AmpguardWarning):  # (ForkedRunWarning is one: a filter on ampguard's catches it)
        again.write(step(3))
    again.close()
    assert steps_of(client, again.run_id) == [1, 2, 3] and client.get_run(again.run_id).data.tags[RUN_ID_TAG] == "R1"
    left = client.get_run(incomplete.info.run_id)
    assert left.info.status == "FAILED" and "ampguard.incomplete_fork" in left.data.tags
    old = client.get_run(first.run_id)
    assert old.info.status == "KILLED" and old.data.tags[SUPERSEDED_BY_TAG] == again.run_id


def test_a_kill_between_the_fork_and_the_old_runs_end_is_mended_when_the_fork_is_continued(tmp_path, monkeypatch):
    uri = (tmp_path / "mlruns").as_uri()
    first = _logged(uri, 3)
    cut = _r1(uri)
    fails_when(monkeypatch, cut.client, "set_tag", lambda run_id, key, value, **_: key == SUPERSEDED_BY_TAG, Killed())
    with pytest.raises(Killed):
        cut.write(step(2))
    monkeypatch.undo()
    client = first.client
    assert client.get_run(first.run_id).info.status == "RUNNING"  # (the kill left it so)
    on = _r1(uri)
    assert on.run_id != first.run_id and steps_of(client, on.run_id) == [1]  # the fork, its history whole
    on.write(step(2))
    on.close()
    old = client.get_run(first.run_id)
    assert old.info.status == "KILLED" and old.data.tags[SUPERSEDED_BY_TAG] == on.run_id


def test_a_fork_whose_old_run_is_gone_is_continued_all_the_same(tmp_path, monkeypatch):
    # the mend of the old run (superseded_by, ended) read it first: purged (mlflow gc), the resume
    # was refused ("log.mlflow: Run ... not found")
    uri = (tmp_path / "mlruns").as_uri()
    first = _logged(uri, 3)
    fork = _r1(uri)
    with pytest.warns(ForkedRunWarning):
        fork.write(step(3))
    fork.close()
    fails_when(monkeypatch, MlflowClient, "get_run", lambda client, run_id: run_id == first.run_id,
               RuntimeError(f"Run '{first.run_id}' not found"))  # (purged: mlflow gc)
    on = _r1(uri)
    on.write(step(4))
    on.close()
    assert on.run_id == fork.run_id and steps_of(first.client, fork.run_id) == [1, 2, 3, 4]
