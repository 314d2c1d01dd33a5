"""Review 37h of ``ampguard report`` on a Hugging Face Trainer's run folder (``steps.csv``,
``summary.json``, the Trainer's ``RUN.md``): a run resumed without ampguard's state observed from
step N + 1 (``summary.json``'s ``unobserved``), and report now replays only the rows after it, so
its alerts, rates and summary line are the run card's; the Trainer card's end is read from its
``ended`` row, not called "no run card ampguard wrote"."""

from __future__ import annotations

import json

from ampguard.report import run
from ampguard.sinks import CSV_COLUMNS

CARD = ("# ampguard run card (Hugging Face Trainer)\n\n| | |\n|---|---|\n"
        "| ended | finished: 10 steps (exit 0) |\n| steps / updates applied | 10 / 2 |\n")


def write_run(folder, steps, skipped, unobserved):
    """A Trainer run folder without config.yaml: rows ``steps`` (fp32: scale 1), those in
    ``skipped`` all-skipped, and a ``summary.json`` saying ``unobserved``."""
    lines = [",".join(CSV_COLUMNS)]
    for step in steps:
        lines.append(f"{step},0.1,inf,,2.0,1,non_finite_grad,1.0" if step in skipped
                     else f"{step},0.1,2.0,1.0,2.0,0,,1.0")
    (folder / "steps.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "summary.json").write_text(json.dumps({"steps": steps[-1], "unobserved": unobserved}), encoding="utf-8")
    (folder / "RUN.md").write_text(CARD, encoding="utf-8")


def test_report_judges_a_resume_without_ampguard_state_over_the_steps_the_run_observed(tmp_path, capsys):
    # review 37h d1 (r2): the live run alerted on 2 skips in the 4 steps after step 6 (and its
    # card said so); report replayed from step 1 with a plain monitor: 2/10, "alert episodes 0"
    write_run(tmp_path, list(range(7, 11)), {7, 8}, 6)
    assert run(tmp_path, plot=False, alert_rate=0.2, min_steps=6) == 0
    out = capsys.readouterr().out
    assert "summary: steps=10 (1 to 6 not observed) updates=2 skips=2 (non_finite_grad=2)" in out
    assert "alert episodes 1 (re-judged at --alert-rate 0.2, --min-steps 6), clip rate 0.500," in out
    assert ("summary.json says steps 1 to 6 were not observed (resumed from a checkpoint without ampguard's "
            "state): the figures cover the CSV's steps 7 to 10, as the run's card\n") in out


def test_report_leaves_out_the_rows_of_the_unobserved_steps_a_stock_trainers_callback_wrote(tmp_path, capsys):
    # review 37h d1 (r10): a stock Trainer + callback resumed in its own out_dir has rows 1..10;
    # its card counted 7..10 and report counted all ten: now both 7..10, the first six drawn only
    write_run(tmp_path, list(range(1, 11)), {9, 10}, 6)
    assert run(tmp_path, plot=False, alert_rate=0.2, min_steps=6) == 0
    out = capsys.readouterr().out
    assert "summary: steps=10 (1 to 6 not observed) updates=2 skips=2" in out
    assert "alert episodes 1 " in out and "clip rate 0.500," in out  # (2 of the 4 steps judged, not of 10)
    assert "the figures cover the CSV's steps 7 to 10, as the run's card; the CSV's 6 rows of those steps are drawn, " \
           "not counted" in out


def test_report_reads_a_trainer_cards_end_from_its_ended_row(tmp_path, capsys):
    # review 37h (also noticed): "RUN.md is no run card ampguard wrote ... ended: unknown" of
    # every Trainer card, which says how the run ended in a table row, not a bold line
    write_run(tmp_path, [1, 2, 3], set(), 0)
    assert run(tmp_path, plot=False) == 0
    out = capsys.readouterr().out
    assert "ended: finished: 10 steps (exit 0)\n" in out
    assert "no run card ampguard wrote" not in out and "not observed" not in out


def test_an_unobserved_count_that_is_no_count_is_not_used(tmp_path):
    from ampguard.report import unobserved_of  # (new in review 37h: the other tests fail on the old tree one by one)

    for text in ('{"unobserved": true}', '{"unobserved": -3}', '{"unobserved": "6"}', "[6]", "not json"):
        (tmp_path / "summary.json").write_text(text, encoding="utf-8")
        assert unobserved_of(tmp_path / "steps.csv") == 0


def test_an_unobserved_count_is_taken_only_from_a_trainers_folder_and_within_its_steps(tmp_path):
    # review 37p: a summary.json beside an ampguard train run's CSV (which observes every step), one past
    # its own steps, and one beside another CSV were all taken: steps=5000 beside "finished: 1000 steps"
    import json

    from ampguard.report import unobserved_of

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 10, "unobserved": 6}), encoding="utf-8")
    assert unobserved_of(tmp_path / "steps.csv") == 6 and unobserved_of(tmp_path / "other.csv") == 0
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 10, "unobserved": 5000}), encoding="utf-8")
    assert unobserved_of(tmp_path / "steps.csv") == 0
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 10, "unobserved": 6}), encoding="utf-8")
    (tmp_path / "config.yaml").write_text("steps: 10\n", encoding="utf-8")
    assert unobserved_of(tmp_path / "steps.csv") == 0


def test_the_unobserved_steps_are_not_called_missing_rows():
    # review 37p: "steps.csv has no row for 6 of its steps (1-6)" read as lost data for steps left out by design
    from pathlib import Path

    from ampguard.report import reading_notes
    from ampguard.sinks import Row

    rows = [Row(s, 0.1, 2.0, 1.0, 0.5, False, "", 1.0) for s in (7, 8, 10)]
    assert reading_notes(Path("steps.csv"), rows, [], unobserved=6) == [
        "steps.csv has no row for 1 of its steps (9): its figures are of the 3 rows it has (a rate over the run's "
        "steps counts the missing ones as neither skipped nor clipped)"]
