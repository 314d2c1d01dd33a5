"""Review 47b: ``report`` and ``compare`` on the folders and CSVs users hand them.

A CSV with no config.yaml beside it (a Lightning plugin's, a Trainer callback's) was judged with
the default ``growth_interval`` (2000), its scale health then not the run's, and a bare CSV got no
note at all; a held-out metric evaluated less often than another lost its "final" value (the
replay kept only the last row's metrics); ``report`` never replayed the held-out metrics; a
metric column of tensors' text (``tensor(0.41)``) dropped unsaid; empty cells a run always
writes, and a rollback event with no count, passed unsaid.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import torch

from ampguard import compare
from ampguard.cli import main
from ampguard.config import validate
from ampguard.monitor import RunMonitor
from ampguard.report import growth_interval_of, reading_notes
from ampguard.sinks import CSV_COLUMNS, Row, read_steps_csv

HEADER = ",".join(CSV_COLUMNS)


def _report(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", *map(str, argv), "--no-plot"])
    return code, out.getvalue(), err.getvalue()


def _swinging_rows(interval: int, steps: int = 4000) -> list[str]:
    """torch's scaler at ``growth_interval`` ``interval`` over gradients 16x apart in turn, 500
    steps each: the scale swings 4 octaves, again and again."""
    scale, tracker = torch.full((), 2.0**16), torch.zeros((), dtype=torch.int32)
    lines = []
    for step in range(1, steps + 1):
        g = 0.4 if (step // 500) % 2 == 0 else 6.4
        overflow = float(scale) * g > 65504
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(overflow)), 2.0, 0.5, interval)
        lines.append(f"{step},0.1,inf,,2.0,1,non_finite_grad,{float(scale)!r}" if overflow else
                     f"{step},0.1,0.5,0.5,2.0,0,,{float(scale)!r}")
    return lines


def test_a_csv_with_no_config_is_judged_by_the_growth_interval_its_rows_show(tmp_path):
    csv = tmp_path / "steps.csv"  # (as AmpGuardPlugin(scaler={"growth_interval": 100}) writes it: no config.yaml)
    csv.write_text("\n".join([HEADER, *_swinging_rows(100)]) + "\n", encoding="utf-8")
    rows = read_steps_csv(csv)
    assert growth_interval_of(rows, 2.0**16) == 100
    own = RunMonitor(window=1000, init_scale=2.0**16, growth_interval=100)  # the plugin's monitor
    for row in rows:
        own.observe(row.record())
    assert own.scale_verdict == "oscillating"
    code, out, err = _report(csv)
    assert code == 0 and not err, (out, err)
    assert (f"note: {csv} has no config.yaml beside it: alerts judged with the default thresholds where none is "
            "given (window 1000, alert rate 0.05, min steps 100: --window, --alert-rate and --min-steps set them); "
            "the scale's health by the scaler's growth_interval read off the rows (100: the clean steps before "
            "each growth)") in out, out
    assert "scale oscillating" in out, out  # (judged at the default 2000: stable, the swing unseen)


def test_a_csv_whose_scale_never_grew_says_the_default_growth_interval_it_took(tmp_path):
    csv = tmp_path / "steps.csv"
    csv.write_text(f"{HEADER}\n1,0.1,0.5,0.5,2.0,0,,1024.0\n2,0.1,inf,,2.0,1,non_finite_grad,512.0\n"
                   "3,0.1,0.5,0.5,2.0,0,,512.0\n", encoding="utf-8")
    code, out, _ = _report(csv, "--window", "2")
    assert code == 0
    assert ("(window 2 (given), alert rate 0.05, min steps 100: --window, --alert-rate and --min-steps set them); "
            "the scale's health by the default growth_interval (2000: no growth in the rows to read it from)") in out


def test_growth_interval_of_reads_the_commonest_run_before_a_growth():
    def rows(trace):
        return [Row(i, 0.1, 1.0, 1.0, 0.5, skipped, "x" if skipped else "", scale)
                for i, (scale, skipped) in enumerate(trace, start=1)]
    # grows after 3 clean steps twice; a resume's jump (4 -> 64 after 1 step) once: the commonest wins
    trace = [(4.0, False)] * 2 + [(8.0, False)] + [(8.0, False)] * 2 + [(16.0, False), (64.0, False)]
    assert growth_interval_of(rows(trace), 4.0) == 3
    assert growth_interval_of(rows([(4.0, True), (2.0, True)]), 8.0) is None
    assert growth_interval_of(rows([(math.inf, False), (4.0, False)]), 2.0) is None  # (inf -> 4: no growth)


# ------------------------------------------------------------------------- held-out metrics


def _run(root: Path, name: str, header_extra: list[str], rows: list[str]) -> Path:
    folder = root / name
    folder.mkdir()
    from ampguard.config import dump_config
    (folder / "config.yaml").write_text(dump_config(validate({"precision": "bf16"})), encoding="utf-8")
    (folder / "steps.csv").write_text("\n".join([",".join([HEADER, *header_extra]), *rows]) + "\n", encoding="utf-8")
    (folder / "RUN.md").write_text(f"# Run {name}\n\n**finished**\n\n## Set-up\n\n| | |\n|---|---|\n", encoding="utf-8")
    (folder / "events.jsonl").write_text("", encoding="utf-8")
    return folder


def _metric_rows(steps: int = 50) -> list[str]:
    out = []
    for step in range(1, steps + 1):
        loss = f"{2.0 - step / 100:.2f}" if step % 10 == 0 else ""
        bleu = f"0.{step}" if step % 25 == 0 else ""
        out.append(f"{step},0.1,0.5,0.5,1.0,0,,1.0,{loss},{bleu}")
    return out


def test_metrics_evaluated_at_other_periods_each_keep_their_last_value(tmp_path, capsys):
    folder = _run(tmp_path, "a", ["val_loss", "val_bleu"], _metric_rows())
    run = compare.load_run(folder)
    assert run.monitor.eval_last == {"val_loss": 1.5, "val_bleu": 0.5}  # (val_bleu's last at step 50, val_loss's too)
    rows = dict(compare.table_rows(run))
    assert rows["val_bleu final / best"] == "0.5 / 0.5" and rows["val_loss final / best"] == "1.5 / 1.5", rows
    code, out, _ = _report(folder)
    assert code == 0
    assert "held-out val_loss final 1.5, best 1.5; val_bleu final 0.5, best 0.5" in out, out


def test_a_metric_column_of_tensors_text_is_said(tmp_path):
    rows = [f"{s},0.1,0.5,0.5,1.0,0,,1.0,{'tensor(0.4100)' if s % 2 else ''},{'main' if s % 2 else 'warmup'}"
            for s in range(1, 5)]
    folder = _run(tmp_path, "t", ["val_top1", "phase"], rows)
    code, out, _ = _report(folder)
    assert code == 0
    assert (f"note: {folder / 'steps.csv'}: column val_top1 holds a tensor's text in every cell (the first "
            "'tensor(0.4100)', at step 1): read as text, left out; write float(t) or t.item() there") in out, out
    assert "column phase" not in out  # (a user's text column: nothing to say)


# --------------------------------------------------------------------- what no run writes


def test_an_empty_cell_an_ampguard_run_always_writes_is_said_there_only():
    rows = [Row(1, 0.1, 1.0, 1.0, 0.5, False, "", 1.0), Row(2, 0.1, 1.0, 1.0, None, False, "", None),
            Row(3, None, None, None, 0.5, True, "non_finite_grad", 1.0)]  # (a skip's empty cells are its own)
    config = validate({"precision": "bf16", "steps": 3})
    said = [n for n in reading_notes(Path("steps.csv"), rows, [], config=config) if "empty cell" in n]
    assert said == ["steps.csv has 1 applied step with an empty cell, which every applied row of an ampguard run "
                    "holds (a hand edit?) (step 2: loss, scaler_scale): read as written"]
    assert not [n for n in reading_notes(Path("steps.csv"), rows, []) if "empty cell" in n]  # (a Trainer's CSV)


def test_a_rollback_event_with_no_count_is_said(tmp_path):
    events = [{"step": 0, "event": "run_start"}, {"step": 2, "event": "rollback", "updates_undone": "two"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    rows = [Row(s, 0.1, 1.0, 1.0, 0.5, False, "", 1.0) for s in (1, 2, 3)]
    notes = reading_notes(tmp_path / "steps.csv", rows, [], tmp_path, config=validate({"steps": 3}))
    assert [n for n in notes if "rollback" in n] == [
        f"{tmp_path / 'events.jsonl'} has 1 rollback with no count of the updates it undid (step 2: updates_undone "
        "'two'): passed over, its updates counted as applied"]


def test_one_line_errors_say_what_is_wrong(tmp_path):
    for name, text, said in (("empty.csv", "", "empty.csv is empty (no header, no step)"),
                             ("bom.csv", "\ufeff", "bom.csv is empty (no header, no step)"),
                             ("twice.csv", f"{HEADER}\n1,0.1,1,1,1,0,,1\n1,0.1,1,1,1,0,,1\n",
                              "twice.csv line 3: step 1 twice (a row repeated)")):
        (tmp_path / name).write_text(text, encoding="utf-8")
        code, out, err = _report(tmp_path / name)
        assert (code, out, err.strip()) == (2, "", f"ampguard: error: {tmp_path / said}"), (out, err)
    for window in ("100000000", "99999999999", "0"):  # (the 1e+09 of a whole number's own range, past 1e+09)
        code, out, err = _report(tmp_path / "twice.csv", "--window", window)
        assert code == 2 and err.strip().endswith(f"--window: must be in [1, 1e+07], got {window}"), err


def test_a_per_step_column_of_a_csv_without_config_is_no_held_out_metric(tmp_path):
    # CsvSink(extra_columns=["val_loss", "tokens_seen"]) in a user's loop: tokens_seen on every row, val_loss
    # every 10 steps; shown as "held-out tokens_seen final 5120, best 256" it would be nonsense
    csv = tmp_path / "steps.csv"
    rows = [f"{s},0.1,0.5,0.5,1.0,0,,1.0,{'0.5' if s % 10 == 0 else ''},{s * 256}" for s in range(1, 21)]
    csv.write_text("\n".join([f"{HEADER},val_loss,tokens_seen", *rows]) + "\n", encoding="utf-8")
    code, out, _ = _report(csv)
    assert code == 0 and "held-out val_loss final 0.5, best 0.5\n" in out and "tokens_seen" not in out, out


def test_a_run_card_that_is_a_folder_is_said_as_such(tmp_path):
    folder = _run(tmp_path, "c", [], ["1,0.1,0.5,0.5,1.0,0,,1.0"])
    (folder / "RUN.md").unlink()
    (folder / "RUN.md").mkdir()
    code, out, _ = _report(folder)
    assert code == 0
    assert f"note: {folder / 'RUN.md'} is not a file (a folder?): no run card read" in out, out
    assert "did not end" not in out  # (review 47b: "no run card ... the run did not end (killed ...)")


def test_compares_errors_say_they_are_compares(tmp_path):
    good = _run(tmp_path, "good", [], ["1,0.1,0.5,0.5,1.0,0,,1.0"])
    bad = _run(tmp_path, "bad", [], ["1,0.1,0.5,0.5,1.0,0,,1.0", "1,0.1,0.5,0.5,1.0,0,,1.0"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["compare", str(good), str(bad)])
    assert code == 2 and err.getvalue() == (
        f"ampguard: error: compare: {bad / 'steps.csv'} line 3: step 1 twice (a row repeated)\n"), err.getvalue()


def test_a_window_given_for_a_csv_without_config_judges_its_scale_health_too(tmp_path):
    # review 47h: a Trainer run at window 16 read "stable" on its card; report judged the scale at the
    # default 1000 ("collapsing": the fall 3 octaves since step 100), and --window 16 changed only the alerts
    rows = [f"{s},0.1,0.5,0.5,1.0,0,,65536.0" for s in range(1, 101)]
    rows += [f"{s},0.1,inf,,1.0,1,non_finite_grad,{2.0 ** (115 - s)!r}" for s in (101, 102, 103)]
    rows += [f"{s},0.1,0.5,0.5,1.0,0,,8192.0" for s in range(104, 200)]
    csv = tmp_path / "steps.csv"
    csv.write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    code, out, _ = _report(csv)
    assert code == 0 and "scale collapsing" in out, out  # (the default window holds the fall)
    code, out, _ = _report(csv, "--window", "16")
    assert code == 0 and "scale stable" in out and "window 16 (given)" in out, out


def test_a_trainer_folder_is_judged_by_the_thresholds_its_summary_records(tmp_path):
    # review 47h: a GuardedTrainer run at window 16 ("stable" on its card) read "collapsing" in report
    rows = [f"{s},0.1,0.5,0.5,1.0,0,,65536.0" for s in range(1, 101)]
    rows += [f"{s},0.1,inf,,1.0,1,non_finite_grad,{2.0 ** (115 - s)!r}" for s in (101, 102, 103)]
    rows += [f"{s},0.1,0.5,0.5,1.0,0,,8192.0" for s in range(104, 200)]
    (tmp_path / "steps.csv").write_text("\n".join([HEADER, *rows]) + "\n", encoding="utf-8")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 199, "thresholds": {
        "window": 16, "alert_rate": 0.2, "min_steps": 5, "growth_interval": 500}}), encoding="utf-8")
    code, out, _ = _report(tmp_path)
    assert code == 0 and "scale stable" in out and "(window 16)" in out, out
    assert ("alerts judged with the thresholds summary.json records where none is given (window 16 (recorded), "
            "alert rate 0.2 (recorded), min steps 5 (recorded): --window, --alert-rate and --min-steps set them); "
            "the scale's health by the growth_interval summary.json records (500)") in out, out
