"""Review 55o F4: after a plot killed (or failed) in a run's end, RUN.md's plot row said "not
drawn" for good, even once ``ampguard report`` drew the folder's report.png. ``report`` now
rewrites that row alone (the card replaced at once, every other byte as it was) when it draws the
run folder's report.png; never while a process trains in the folder, never a card without such a
row, never for a plot drawn elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampguard import report
from ampguard.config import validate
from ampguard.errors import ExitCode
from ampguard.run_folder import RunPaths, RunResult
from ampguard.sinks import CSV_COLUMNS, read_steps_csv

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py

DRAWN = "| plot | `report.png` (drawn after the run by `ampguard report`) |"


def ended_run(folder: Path, plot: str | None, **config: object) -> bytes:
    """A 3-step run folder whose card's plot row is ``plot`` (None: the row the run writes for
    ``config``); the card's bytes."""
    (folder / "steps.csv").write_text(",".join(CSV_COLUMNS) + "\n" + "".join(
        f"{s},0.001,1.5,1.0,0.5,0,,65536.0\n" for s in range(1, 4)), encoding="utf-8")
    result = RunResult(ExitCode.OK, report.replay(read_steps_csv(folder / "steps.csv"), init_scale=65536.0),
                       RunPaths.existing(folder), "finished: 3 steps", torch.device("cpu"))
    report.write_run_card(folder / "RUN.md", validate(config), result, plot)
    return (folder / "RUN.md").read_bytes()


def plot_row(card: bytes) -> str:
    [row] = [line for line in card.decode().splitlines() if line.startswith("| plot |")]
    return row


@pytest.mark.parametrize("plot, config, left_alone", [
    (report.PLOT_BEING_DRAWN, {}, "elsewhere"),  # (a kill in the run's end's plot)
    ("not drawn: no room for the figure (`ampguard report` draws it)", {}, "training"),  # (a plot that failed there)
    (None, {"log": {"plot": False}}, "named"),  # (log.plot false)
], ids=["killed", "failed", "log.plot-false"])
def test_report_names_the_plot_it_drew_on_a_card_that_said_it_was_not_drawn(tmp_path, capsys, plot, config,
                                                                              left_alone):
    # each card's row is rewritten once report draws the run's report.png; the cases that leave the
    # card alone (--no-plot, each; a plot drawn elsewhere, a run training in the folder, a card that
    # names its plot) do not depend on which "not drawn" row it holds (card_after_report only
    # matches it), so each card meets one of the three: 6 plots drawn, not 12 (~0.65 s of CPU each)
    card = tmp_path / "RUN.md"
    before = ended_run(tmp_path, plot, **config)
    assert plot_row(before).startswith("| plot | not drawn")
    inode = card.stat().st_ino
    # left alone: --no-plot, a plot drawn elsewhere, a run training in the folder (it writes its own card)
    assert report.run(tmp_path, plot=False) == ExitCode.OK
    if left_alone == "elsewhere":
        assert report.run(tmp_path, out=tmp_path / "elsewhere.png") == ExitCode.OK
    if left_alone == "training":
        live = RunPaths.existing(tmp_path)
        live.lock()
        try:
            assert report.run(tmp_path) == ExitCode.OK and (tmp_path / "report.png").is_file()
        finally:
            live.unlock()
    assert card.read_bytes() == before and card.stat().st_ino == inode
    assert "its plot row" not in capsys.readouterr().out
    # the run's folder's report.png drawn, nobody training there: that row names it, the rest byte for byte
    assert report.run(tmp_path) == ExitCode.OK
    after = card.read_bytes()
    assert after == before.replace(plot_row(before).encode(), DRAWN.encode())
    out = capsys.readouterr().out
    assert f"note: {card}: its plot row said the plot was not drawn; it names report.png now" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["RUN.md", "report.png", "steps.csv"] + (["elsewhere.png"] if left_alone == "elsewhere" else []))
    if left_alone == "named":  # a card that names its plot: left as it is
        inode = card.stat().st_ino
        assert report.run(tmp_path) == ExitCode.OK
        assert card.read_bytes() == after and card.stat().st_ino == inode
        assert "its plot row" not in capsys.readouterr().out
