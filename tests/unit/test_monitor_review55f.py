"""Review 55f: a monitor that began after a resume which took a stock fp16 checkpoint's loss scale
over (``begin_at(step, taken_over=scale)``) says its opening search started from that scale, not
from ``init_scale``; the scale is saved with its state, checked as the other fields are."""

from __future__ import annotations

import pytest

from ampguard.monitor import RunMonitor
from ampguard.records import SkipLog


def _overflow(step, scale):
    return SkipLog(step=step, lr=0.1, loss=1.0, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
                   scaler_scale=scale, reason="non_finite_grad")


def test_the_search_taken_over_is_named_at_the_end_and_after_a_resume_with_the_state():
    m = RunMonitor(fail_rate=0.5, init_scale=512.0, min_scale=1.0)
    m.begin_at(4, taken_over=512.0)
    _ = m.observe(_overflow(5, 256.0))
    saved = m.state_dict()
    assert saved["taken_over_scale"] == 512.0
    resumed = RunMonitor(fail_rate=0.5, init_scale=512.0, min_scale=1.0)
    resumed.load_state_dict(saved)
    _ = resumed.observe(_overflow(6, 128.0))
    alert, failed = resumed.at_end(6)
    assert alert.message == ("no step applied in the 2 steps after step 4: the fp16 loss scale's search down from "
                             "512, the scale taken over from the checkpoint's stock GradScaler, never found a scale "
                             "(now 128)")
    assert failed.message.startswith(alert.message + ", a skip rate of 1 above fail_rate 0.5")
    fresh = RunMonitor(init_scale=512.0)  # (none taken over, and a state saved before the field: init_scale)
    fresh.load_state_dict({k: v for k, v in RunMonitor(init_scale=512.0).state_dict().items() if k != "taken_over_scale"})
    _ = fresh.observe(_overflow(1, 256.0))
    assert "search down from init_scale never found a scale (now 256)" in fresh.at_end(1)[0].message


@pytest.mark.parametrize("bad", ["512", float("nan"), 0.0, -1.0, 1e39, True])
def test_a_taken_over_scale_that_is_none_is_refused(bad):
    with pytest.raises(ValueError, match=r"^taken_over_scale is .*, expected a loss scale in \(0, 3\.40282e\+38\] or "
                                         r"None$"):
        RunMonitor().check_state({**RunMonitor().state_dict(), "taken_over_scale": bad})
    with pytest.raises(ValueError, match=r"^RunMonitor\.begin_at: taken_over must be a loss scale"):
        RunMonitor().begin_at(3, taken_over=bad)
