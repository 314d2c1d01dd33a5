"""Review 55f, the take-over of a stock fp16 checkpoint's GradScaler state (review 54m) at its edges.

- After a take-over the fp16 search for a scale starts from the scale taken over: a resumed fit
  whose every step overflowed ended with an ALERT saying the search "down from init_scale" never
  found one. The monitor keeps the scale it took over (saved with its state), and says it.
"""

from __future__ import annotations

import warnings

import pytest

from test_lightning import Digits, fit
from test_lightning_review54m import STOCK, _stock_checkpoint

pytest.importorskip("lightning")

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.precision import SlowPrecisionWarning  # noqa: E402


def _alerts(run):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run()
    said = [str(w.message) for w in seen
            if issubclass(w.category, AmpguardWarning) and not issubclass(w.category, SlowPrecisionWarning)]
    return result, said


def test_the_end_s_alert_names_the_scale_taken_over_as_where_the_search_began(tmp_path):
    """Every resumed step overflows: 512 (taken over) -> 256 -> 128, and the search found no scale.
    Saved mid-search and resumed with ampguard's own state, the next fit's end says it too."""
    ckpt = _stock_checkpoint(tmp_path / "stock.ckpt")
    plugin = AmpGuardPlugin("16-mixed", scaler=STOCK)
    trainer, said = _alerts(lambda: fit(Digits(hidden=8, faults=["inf_grad@5", "inf_grad@6"]), plugin, steps=6,
                                        ckpt_path=ckpt))
    assert [float(r.scaler_scale) for r in plugin.records] == [256.0, 128.0]
    alert = [line for line in said if "ALERT" in line]
    assert len(alert) == 1 and ("no step applied in the 2 steps after step 4: the fp16 loss scale's search down "
                                "from 512, the scale taken over from the checkpoint's stock GradScaler, never "
                                "found a scale (now 128)") in alert[0], said
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    again = AmpGuardPlugin("16-mixed", scaler=STOCK)
    _, said = _alerts(lambda: fit(Digits(hidden=8, faults=["inf_grad@7"]), again, steps=7,
                                  ckpt_path=tmp_path / "mid.ckpt"))
    assert [float(r.scaler_scale) for r in again.records] == [64.0]
    assert any("search down from 512, the scale taken over from the checkpoint's stock GradScaler, never found a "
               "scale (now 64)" in line for line in said), said
    assert not any("init_scale" in line for line in said), said
