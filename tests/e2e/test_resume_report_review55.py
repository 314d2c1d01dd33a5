"""Review 55d, end to end: ``train --resume`` of a teammate's run folder whose ``events.jsonl`` is
that user's link to root's file is refused in one line and leaves the folder as it was; ``report``
prints what a run folder holds (a metric's name, the card's end, the ``run_end`` message, the
folder's own name) with its control characters escaped."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import ag, deadline, ok, one_error_line, snapshot_of, train

LINEAR = ["--set", "task.name=linear", "--set", "precision=fp32", "--set", "log.plot=false", "--set", "steps=4",
          "--set", "checkpoint.every=2", "--set", "log.every=1000"]
NOBODY = 65534


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("links55")
    ok(train(root, "base", *LINEAR))
    return root / "base"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to make a link another user's)")
def test_a_resume_refuses_another_users_events_link_and_leaves_the_folder_as_it_was(base, tmp_path):
    # review 55d F1: the resume appended its events to root's file through the teammate's link (steps.csv's
    # link was refused, events.jsonl's followed); refused now before the folder changes (config.yaml, the card)
    secret = tmp_path / "rootonly"
    secret.mkdir(mode=0o700)
    victim = secret / "events.jsonl"
    team = tmp_path / "team"
    shutil.copytree(base, team)
    shutil.move(team / "events.jsonl", victim)
    for path in [team, *team.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    (team / "events.jsonl").symlink_to(victim)
    os.lchown(team / "events.jsonl", NOBODY, NOBODY)
    before, kept = snapshot_of(team), victim.read_bytes()
    # (from step 2, so the CSV has rows to cut: review 55w, the CSV was cut before events.jsonl was refused)
    with deadline(120):
        line = one_error_line(ag("train", "--resume", team / "checkpoints" / "step-00000002.pt", "--set", "steps=6"))
    link = team / "events.jsonl"
    assert line == (f"ampguard: error: cannot write {link}: {link} is a symbolic link of user {NOBODY}'s to {victim}, "
                    "which is not theirs; refusing to write through it")
    assert victim.read_bytes() == kept and snapshot_of(team) == before


def test_report_prints_a_run_folders_text_with_its_control_characters_escaped(base, tmp_path):
    # review 55d F5: a metric's name in the CSV header, the card's bold end line and (with no card) the
    # run_end message reached the terminal raw: a cleared screen, a line overwritten
    run = tmp_path / "run\x1b[31mred"
    shutil.copytree(base, run)
    with (run / "steps.csv").open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    rows[0] = [name.replace("val_loss", "val_\x1b[2Jx") for name in rows[0]]
    with (run / "steps.csv").open("w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    card = (run / "RUN.md").read_text(encoding="utf-8")
    (run / "RUN.md").write_text(card.replace("finished: 4 steps**", "finished: 4 steps\x1b[44mCARD**"), encoding="utf-8")
    out = ok(ag("report", "--no-plot", run))
    assert "\x1b" not in out and "\r" not in out, out
    assert "held-out val_\\x1b[2Jx final" in out and "ended: finished: 4 steps\\x1b[44mCARD" in out

    (run / "RUN.md").unlink()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    for event in events:
        if event["event"] == "run_end":
            event["message"] = "stopped\x1b[2J\x1b[31mEVIL\rX"
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    out = ok(ag("report", "--no-plot", run))
    assert "\x1b" not in out and "\r" not in out, out
    assert "the run ended (stopped\\x1b[2J\\x1b[31mEVIL\\rX)" in out
    assert "note: " + str(run).replace("\x1b", "\\x1b") + " has no run card" in out  # (the folder's name too)
