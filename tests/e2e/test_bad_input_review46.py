"""Review 46b: bad input that still escaped the one-line rule (exit 2, no traceback, nothing
written): a metric cell of text in report's CSV (a traceback after the plot was written),
structures nested past Python's recursion limit in four readers, and a resume whose run monitor
state was missing, junk or past the checkpoint's step (taken silently: the card's "updates
applied" then disagreed with the CSV)."""
import contextlib
import io
import json
import sys

import pytest
import torch
from helpers import ag, one_error_line, snapshot_of, train

from ampguard.checkpoint import load_checkpoint, save_checkpoint
from ampguard.cli import main
from ampguard.errors import InputError
from ampguard.locate import load_batches
from ampguard.validate import earlier_rejections

HEADER = "step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale"


def _nested(depth: int = 3000) -> list:
    deep = cur = []
    for _ in range(depth):
        cur.append([])
        cur = cur[0]
    return deep


def _save_deep(data: dict, path) -> None:
    """``torch.save`` of a structure past the recursion limit (pickling recurses; loading does not)."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        torch.save(data, path)
    finally:
        sys.setrecursionlimit(limit)


def _report(*argv) -> tuple[int, str, str]:
    """``ampguard report`` in-process with its real plot (helpers.ag skips the plot)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *map(str, argv)])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("plot", [True, False])
def test_report_reads_a_metric_column_with_a_cell_of_text_as_text_and_says_so(tmp_path, plot):
    # review 46b: a traceback after the plot was written; 46e: a refusal by name refused legit text columns
    csv = tmp_path / "steps.csv"
    csv.write_text(f"{HEADER},val_accuracy,val_top1\n1,0.003,2.1,0.99,1.39,0,,1.0,,0.4\n"
                   "2,0.003,1.7,0.99,1.14,0,,1.0,n/a,ERR\n3,0.003,1.6,0.99,1.01,0,,1.0,0.5,0.6\n")
    code, out, err = _report(csv, *([] if plot else ["--no-plot"]))
    assert code == 0 and not err, (out, err)
    for column, first in (("val_accuracy", "'n/a'"), ("val_top1", "'ERR'")):
        assert (f"note: {csv}: column {column} holds numbers and text (its first text {first}, at step 2"
                in out), out
    assert (tmp_path / "steps.png").exists() == plot


def test_a_text_column_with_a_cell_that_reads_as_a_number_is_still_text(tmp_path):
    # review 46d: a user's commit column of short SHAs, '2113e02' a float (211300.0), '6ba2a38' not: the
    # column was taken for a metric and refused; by report (since 46b's check) and by compare (before)
    # (and columns of text named like metrics: precision, accelerator, loss_fn)
    rows = "".join(f"{i},0.003,2.1,0.99,1.39,0,,1.0,{sha},{phase},bf16,cpu,mse\n"
                   for i, (sha, phase) in enumerate([("2113e02", "warmup"), ("6ba2a38", "main")], start=1))
    csv = tmp_path / "steps.csv"
    csv.write_text(f"{HEADER},commit,phase,precision,accelerator,loss_fn\n{rows}")
    code, out, err = ag("report", csv)
    assert code == 0 and "steps=2" in out and "column commit holds numbers and text" in out, (out, err)
    assert "column precision" not in out and "column phase" not in out  # (columns of text: nothing to say)
    for name in ("a", "b"):  # compare, on two run folders holding that CSV
        (tmp_path / name).mkdir()
        (tmp_path / name / "steps.csv").write_text(csv.read_text())
        (tmp_path / name / "config.yaml").write_text("precision: fp32\nsteps: 2\n")
        (tmp_path / name / "RUN.md").write_text(f"# Run {name}\n\n**finished: 2 steps**\n")
    code, out, err = ag("compare", tmp_path / "a", tmp_path / "b")
    assert code == 0 and "Traceback" not in err, (out, err)


def test_report_reads_a_summary_nested_past_the_parsers_depth_as_none(tmp_path):
    (tmp_path / "steps.csv").write_text(f"{HEADER}\n1,0.003,2.1,0.99,1.39,0,,1.0\n2,0.003,1.7,0.99,1.14,0,,1.0\n")
    (tmp_path / "summary.json").write_text("[" * 100_000)
    code, out, err = ag("report", tmp_path / "steps.csv")
    assert code == 0 and "steps=2" in out and "Traceback" not in err, (out, err)


def test_validates_history_skips_a_line_nested_past_the_parsers_depth(tmp_path):
    history = tmp_path / "validate-history.jsonl"
    old = {"weights": "w", "probe_set": "p", "rules": {"validation.max_flips": 0}}
    rejected = {**old, "accepted": False, "verdict": "REJECTED", "time": "t", "report": "r"}
    history.write_text("[" * 100_000 + "\n" + json.dumps(rejected) + "\n")
    found = earlier_rejections(history, {**old, "rules": {"validation.max_flips": 1}})
    assert [e["changed"] for e in found] == [["validation.max_flips: 0 -> 1"]], found


def test_a_checkpoint_whose_format_is_deeply_nested_is_one_line(tmp_path):
    path = save_checkpoint(tmp_path / "deep.pt", {"step": 1})
    payload = torch.load(path, weights_only=True)
    payload["format"] = _nested()
    _save_deep(payload, path)
    with pytest.raises(InputError, match=r"deep\.pt: checkpoint format a list of 1, this ampguard reads"):
        load_checkpoint(path)


def test_a_batch_file_nested_past_the_recursion_limit_is_one_line(tmp_path):
    _save_deep({"inputs": _nested(), "targets": torch.zeros(2, 1)}, tmp_path / "deep.pt")
    with pytest.raises(InputError, match=r"deep\.pt: the batch's inputs or targets are nested too deep to read"):
        load_batches(str(tmp_path / "deep.pt"))


@pytest.mark.parametrize("edit, said", [
    (lambda monitors: monitors.pop("run"), "state.monitors has no 'run' (the run monitor's counts)"),
    (lambda monitors: monitors.__setitem__("run", {"a": 1}), "state.monitors.run.steps is missing"),
    (lambda monitors: monitors["run"].__setitem__("updates", 10**9),
     "state.monitors.run.updates is 1000000000, expected an int in [0, steps 4]"),
    (lambda monitors: monitors["run"].update(steps=9, updates=9),
     "state.monitors.run.steps is 9, expected at most 4 (the checkpoint's step)"),
], ids=["no run", "junk", "updates past steps", "steps past the checkpoint"])
def test_a_resume_refuses_a_run_monitor_state_it_cannot_count_on(tmp_path, edit, said):
    ok = ["--set", "task.name=linear", "--set", "task.batch_size=4", "--set", "log.plot=false",
          "--set", "precision=fp32"]
    assert train(tmp_path, "r", *ok, "--set", "steps=4")[0] == 0
    (checkpoint,) = (tmp_path / "r" / "checkpoints").glob("step-*.pt")
    payload = torch.load(checkpoint, weights_only=True)
    edit(payload["state"]["monitors"])
    save_checkpoint(checkpoint, {k: v for k, v in payload.items() if k not in ("magic", "format")})
    before = snapshot_of(tmp_path)
    line = one_error_line(ag("train", "--resume", tmp_path / "r", "--set", "steps=6"))
    assert f"bad checkpoint: {said}" in line, line
    assert snapshot_of(tmp_path) == before
