"""Review 55f: after GuardedTrainer takes a stock ``scaler.pt``'s scale over (review 54s), the fp16
search for a scale starts from it: a resumed run whose every step overflowed ended with an ALERT
saying the search "down from init_scale" never found one. At ``global_step`` 0 the monitor was not
told of the take-over at all, and the resume event said the monitor left out "steps 1 to 0"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_transformers_review import events, stock_checkpoint
from test_transformers_review54s import _resume, _stock_scaler_pt

pytest.importorskip("transformers")


@pytest.mark.parametrize("step", [2, 0])
def test_the_end_s_alert_names_the_scale_taken_over_as_where_the_search_began(tmp_path, step):
    """A scale of 2**120 taken over: every fp16 step overflows, halving, and none applies."""
    checkpoint = stock_checkpoint(tmp_path, 2, 2)
    _stock_scaler_pt(tmp_path, checkpoint, scale=2.0**120)
    if step == 0:  # (a checkpoint saved before any step: HF's trainer state says so)
        state = Path(checkpoint, "trainer_state.json")
        state.write_text(json.dumps({**json.loads(state.read_text()), "global_step": 0, "log_history": []}))
    rows, said = _resume(tmp_path, checkpoint, 4)
    assert [skipped for skipped, _ in rows] == ["1"] * (4 - step)
    assert "scale 1.32923e+36" in said and ("the monitor observes from step 3 (its counts and judgement leave steps "
                                            "1 to 2 out)" if step else "the monitor observes every step") in said, said
    alert = [e["message"] for e in events(tmp_path) if e["event"] == "skip_rate_alert"]
    observed = "the 2 steps after step 2" if step else "the run's 4 steps"
    assert alert == [f"no step applied in {observed}: the fp16 loss scale's search down from 1.32923e+36, the scale "
                     f"taken over from the checkpoint's stock GradScaler, never found a scale (now "
                     f"{2.0 ** (120 - len(rows)):g})"], alert
