"""Review 48b, M2: under DDP (torchrun, 2 CPU ranks, gloo) rank 0's refusal of its files (a
``steps.csv`` that exists, a folder it cannot make) is raised on every rank, the same one line,
before any collective of the training loop: by the Hugging Face ``GuardedTrainer`` (its
``AmpGuardCallback``) and by the Lightning ``AmpGuardPlugin``. It was raised on rank 0 alone; rank
1 went on into the loop and died in a collective (gloo's "Connection closed by peer", a
traceback; under NCCL it would have waited there). Each test reads one launch of
tests/dist_scripts/ranks_review48.py: two refused fits, then one that trains (the ranks still in
step after the refusals), every rank's stderr in a file of its own (torchrun's ``--redirects``)."""

from __future__ import annotations

import re
from pathlib import Path

from helpers import EARLY_TIMEOUT_S, TORCHRUN, WARM_TORCHRUN, Ended, run_to_end, torchrun_env, warm_workers

pytestmark = TORCHRUN

SCRIPT = Path(__file__).resolve().parents[1] / "dist_scripts" / "ranks_review48.py"
UNMAKEABLE = "/proc/ampguard_review48"  # (no file can be made in /proc, root or not)
PEER_CRASH = ("Connection closed by peer", "reset by peer", "Broken pipe")
"""What a rank left in a collective its peer never joined says (a crash of its own shows in its
exit code, checked too: not any "Traceback", which a library's noise at exit under load may print)."""


def _launch(work: Path, framework: str, targets: list[str]) -> Ended:
    folder = work / framework
    workers, env = warm_workers(torchrun_env())
    cmd = [*WARM_TORCHRUN, "--log-dir", str(folder / "logs"), "--redirects", "2", *workers, str(SCRIPT), framework, str(folder),
           *targets]
    return run_to_end(framework, cmd, folder, timeout_s=EARLY_TIMEOUT_S, env=env)


def early(work: Path) -> dict[str, Ended]:
    """The two launches of the tests below, each run to its end (an early job: conftest.py)."""
    (work / "hf" / "kept").mkdir(parents=True)
    (work / "hf" / "kept" / "steps.csv").write_text("step\n")  # (a run's before: never overwritten)
    (work / "pl").mkdir()
    (work / "pl" / "steps.csv").write_text("step\n")
    return {
        "hf": _launch(work, "hf", [str(work / "hf" / "kept"), UNMAKEABLE, str(work / "hf" / "new"),
                                   f"callable:{work / 'hf' / 'callable'}", f"stock:{work / 'hf' / 'stock'}",
                                   f"retry:{work / 'hf' / 'retry'}", f"stock:{work / 'hf' / 'kept'}"]),
        "pl": _launch(work, "pl", [str(work / "pl" / "steps.csv"), f"{UNMAKEABLE}/steps.csv",
                                   str(work / "pl" / "new" / "steps.csv"), f"rank0:{work / 'pl' / 'rank0.csv'}"]),
    }


def _each_ranks_stderr(done: Ended) -> dict[int, str]:
    """``{rank: its stderr}``, from torchrun's ``--log-dir`` (``<run id>/attempt_0/<rank>/stderr.log``)."""
    files = sorted((done.cwd / "logs").glob("*/attempt_0/*/stderr.log"))
    return {int(f.parent.name): f.read_text(errors="replace") for f in files}


def _exit_codes(done: Ended) -> dict[int, int]:
    """``{rank: its exit code}`` as torchrun's failure report gives them (a rank that exited 0 is not in it)."""
    return {int(rank): int(code) for rank, code in
            re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", done.stderr)}


def _check_every_rank_refused(done: Ended, refusals: list[str], trained: str) -> None:
    stderr = _each_ranks_stderr(done)
    assert sorted(stderr) == [0, 1], (done.stderr[-3000:], list((done.cwd / "logs").rglob("*")))
    for rank, text in stderr.items():
        lines = [line for line in text.splitlines() if line.startswith("ampguard: error:")]
        # (every rank's tail: a line missing here is often another rank's crash, told in its own stderr)
        assert lines == [f"ampguard: error: {refusal}" for refusal in refusals], (rank, {r: t[-3000:] for r, t in
                                                                                   stderr.items()})
        crashed = [words for words in PEER_CRASH if words in text]
        assert not crashed, (rank, crashed, text[-4000:])
    assert _exit_codes(done) == {0: 2, 1: 2}, done.stderr[-3000:]  # ExitCode.BAD_INPUT, on every rank
    # the fit after the refusals trained on both ranks: they left them in step
    assert done.stdout.count(f"trained {trained}\n") == 2, (done.stdout, done.stderr[-3000:])


def _tracker_runs(work: Path, framework: str, experiment: str | None = None) -> dict[str, int]:
    """The MLflow runs of the fit that trained (in the ``framework`` launch's store, the experiment
    named after it unless given): ``{its 'ampguard.ended' tag: how many steps of loss}``."""
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # (MLflow 3 refuses a file store without)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file:{work / framework / 'mlruns'}")
    # (every experiment of that name: two processes making it at once in a file store can make two, MLflow's race)
    ids = [e.experiment_id for e in client.search_experiments() if e.name == (experiment or framework)]
    runs = client.search_runs(ids)
    return {run.data.tags.get("ampguard.ended", ""): len(client.get_metric_history(run.info.run_id, "train/loss"))
            for run in runs}


def _check_unserved_sinks(done: Ended, work: Path, framework: str, who: str) -> None:
    """Review 48b L1: the tracker sink made on rank 1 ended at once, its run saying why (it read
    "a start that was refused, or a sink never written"), a warning on rank 1; rank 0's logged."""
    runs = _tracker_runs(work, framework)
    assert len(runs) == 2 and runs.pop("this sink logged no step: it was given to process 1, and only process 0 "
                                       "logs (build the tracker sinks on process 0 alone)") == 0, runs
    assert list(runs.values()) == [2], runs  # rank 0's: both steps
    stderr = _each_ranks_stderr(done)
    warned = f"{who}: 1 tracker sink(s) given to process 1 were ended unused: only process 0 logs"
    assert warned in stderr[1] and warned not in stderr[0], stderr[1][-3000:]


def test_guarded_trainer_under_ddp_refuses_rank_0s_files_on_every_rank(launches, work):
    """An existing ``steps.csv`` in ``out_dir`` and an ``out_dir`` rank 0 cannot make (judged by
    ``errors.unwritable``): the same line on both ranks, exit 2 each, no rank in HF's collectives."""
    done = launches["hf"]
    kept = work / "hf" / "kept" / "steps.csv"
    _check_every_rank_refused(done, [
        f"{kept} already exists; refusing to overwrite it",
        f"AmpGuardCallback(out_dir=...): {UNMAKEABLE} cannot be made: no file can be made in /proc "
        f"(No such file or directory)",
        f"{kept} already exists; refusing to overwrite it",  # (a stock Trainer's callback: review 48g)
    ], str(work / "hf" / "new"))
    assert kept.read_text() == "step\n"  # the user's file, untouched
    assert (work / "hf" / "new" / "steps.csv").read_text().count("\n") == 3  # rank 0 alone writes: a header, 2 rows
    _check_unserved_sinks(done, work, "hf", "AmpGuardCallback")
    # (review 48f: sinks given as a function of the state were made on every process, one empty run each)
    assert list(_tracker_runs(work, "hf", "hf_callable").values()) == [2]
    # (review 48g: a stock Trainer's callback trains through the shared refusal's collective on every process)
    assert done.stdout.count(f"trained stock:{work / 'hf' / 'stock'}\n") == 2, done.stdout
    assert (work / "hf" / "stock" / "steps.csv").read_text().count("\n") == 3
    # (review 48f: an auto_find_batch_size retry was told from process 0's files alone: process 1, taking it for a
    # new train(), refused its sinks as "closed", process 0 died in the shared refusal's collective)
    assert done.stdout.count(f"trained retry:{work / 'hf' / 'retry'}\n") == 2, done.stdout
    assert '"event": "retry"' in (work / "hf" / "retry" / "events.jsonl").read_text()


def test_lightning_plugin_under_ddp_refuses_rank_0s_csv_on_every_rank(launches, work):
    """An existing ``csv=`` and one in a folder rank 0 cannot make (``_check_writable``): the same
    line on both ranks, exit 2 each, no rank in Lightning's barrier or DDP's collectives."""
    done = launches["pl"]
    kept = work / "pl" / "steps.csv"
    _check_every_rank_refused(done, [
        f"{kept} already exists; refusing to overwrite it",
        f"AmpGuardPlugin csv='{UNMAKEABLE}/steps.csv': {UNMAKEABLE} cannot be made: no file can be made in /proc "
        f"(No such file or directory); give a csv path in a folder you can write",
    ], str(work / "pl" / "new" / "steps.csv"))
    assert kept.read_text() == "step\n"
    assert (work / "pl" / "new" / "steps.csv").read_text().count("\n") == 3
    _check_unserved_sinks(done, work, "pl", "AmpGuardPlugin")
    # (review 48f: a csv given on rank 0 alone left rank 0 waiting for good in the shared refusal's collective)
    assert done.stdout.count(f"trained rank0:{work / 'pl' / 'rank0.csv'}\n") == 2, done.stdout
    assert (work / "pl" / "rank0.csv").read_text().count("\n") == 3
