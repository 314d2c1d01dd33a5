"""Review 48a's headroom findings: a resume cuts ``headroom.csv`` back to its step whether or not
the resumed run measures headroom, and refuses one whose kept rows ``report`` could not read
(as it refuses such a steps.csv); a gradient that overflowed at a small loss scale alerts with
the headroom it has at most, not ``-inf``.

Runs go through ``ampguard.cli.main`` in-process (``helpers.ag``; the plot is stubbed out), on
the linear task in bf16, 8 steps each.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
from torch import nn

import helpers
from helpers import ag, ok, read_rows

from ampguard.headroom import Headroom
from ampguard.report import headroom_alerts_text

RUN = ["--set", "task.name=linear", "--set", "precision=bf16", "--set", "steps=8", "--set", "checkpoint.every=4",
       "--set", "monitor.headroom.every=2", "--set", "log.plot=false", "--set", "eval.enabled=false"]


def _trained_to_8_resumable_from_4(tmp_path):
    ok(helpers.train(tmp_path, "r", *RUN))
    run = tmp_path / "r"
    (run / "checkpoints" / "step-00000008.pt").unlink()  # the future after step 4 is abandoned
    return run


def _through(path, step: int) -> bytes:
    """The lines of a headroom.csv up to ``step``'s rows."""
    lines = path.read_bytes().splitlines(keepends=True)
    return b"".join(lines[:1] + [line for line in lines[1:] if int(line.split(b",")[0]) <= step])


def test_a_resume_with_the_monitor_off_cuts_headroom_csv_back_to_its_step(tmp_path):
    # review 48a, 1: the rows of steps 6 and 8 (the abandoned timeline's) stayed, and report drew them
    run = _trained_to_8_resumable_from_4(tmp_path)
    kept = _through(run / "headroom.csv", 4)
    assert kept != (run / "headroom.csv").read_bytes()
    assert "RESUME 4" in ok(ag("train", "--resume", run, "--set", "monitor.headroom.every=null",
                               "--set", "optimizer.lr=0.3"))
    assert (run / "headroom.csv").read_bytes() == kept
    assert [int(r["step"]) for r in read_rows(run / "steps.csv")] == list(range(1, 9))


def test_a_resume_refuses_a_kept_headroom_row_with_a_cell_that_is_no_number(tmp_path, snapshot):
    # review 48a, 2: a kept row "4,...,abc,..." passed (steps.csv's like it is refused); report then
    # left the whole heatmap out
    run = _trained_to_8_resumable_from_4(tmp_path)
    _spoil_a_kept_row(run)
    before = snapshot(run)
    line = helpers.one_error_line(ag("train", "--resume", run))
    assert "headroom.csv: line 3 is not a headroom row" in line and "cannot resume from it" in line, line
    assert snapshot(run) == before


def _spoil_a_kept_row(run) -> None:
    lines = (run / "headroom.csv").read_bytes().splitlines(keepends=True)
    cells = lines[2].split(b",")
    assert cells[0] == b"2"
    lines[2] = b",".join(cells[:3] + [b"abc"] + cells[4:])  # step 2's second row: its amax no number
    (run / "headroom.csv").write_bytes(b"".join(lines))


@pytest.mark.parametrize("spoiled", ["a row", "the columns"])
def test_a_resume_with_the_monitor_off_leaves_a_headroom_csv_it_cannot_cut_back_and_says_so(tmp_path, spoiled):
    # (review 48e: with the monitor off the run neither writes nor reads headroom.csv: a damaged one
    # refused the resume; now it is left as it is, a warning naming it)
    run = _trained_to_8_resumable_from_4(tmp_path)
    if spoiled == "a row":
        _spoil_a_kept_row(run)
    else:
        (run / "headroom.csv").write_text("step,module,tensor,amax\n2,(root),input,1.0\n", encoding="utf-8")
    helpers.resumed_leaving_as_is(run, "headroom.csv", "monitor.headroom.every=null")


def test_a_gradient_that_overflowed_at_a_small_loss_scale_alerts_with_the_headroom_it_has_at_most(tmp_path):
    # review 48a, 3: "headroom -inf bits" (judged_bits -inf) for a gradient that overflowed scaled
    # at loss scale 16: without the scale it is above 65504 / 16 = 4094, so below 4 bits, not inf
    model = nn.Sequential(OrderedDict(fc=nn.Linear(1, 1, bias=False)))
    model.fc.weight.data.fill_(1.0)
    headroom = Headroom(model, "fp16", every=1, alert_bits=4.0, loss_scale=lambda: torch.tensor(16.0))
    with headroom.measuring(15):
        (model(torch.ones(1, 1)).sum() * math.inf).backward()  # (the scaled gradients overflowed, as fp16's do)
    (alert,) = headroom.observe_step(15)
    assert alert.kind == "headroom_alert" and alert.data["headroom_bits"] == -math.inf  # (the CSV's: it is inf)
    judged = alert.data["judged_bits"]
    assert math.isfinite(judged) and judged < 4.0 and judged == pytest.approx(4.0)
    assert "-inf" not in alert.message and "inf at loss scale" not in alert.message, alert.message
    assert alert.message == ("headroom_alert: fc grad overflowed at loss scale 16: headroom < 4 bits without the "
                             "loss scale, alert_bits 4 (amax > 4094 unscaled, fp16 max 65504)")
    # the run card's line of it: below the threshold, not "-inf bits" nor "4.0 bits"
    (tmp_path / "events.jsonl").write_text(
        '{"step": 15, "event": "headroom_alert", "module": "fc", "tensor": "grad", "judged_bits": %r, '
        '"alert_bits": 4.0}\n' % judged, encoding="utf-8")
    assert headroom_alerts_text(tmp_path) == "1 (step 15: fc grad < 4.0 bits)"
