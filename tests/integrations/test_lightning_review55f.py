"""Review 55f, the take-over of a stock fp16 checkpoint's GradScaler state (review 54m) at its edges.

- After a take-over the fp16 search for a scale starts from the scale taken over: a resumed fit
  whose every step overflowed ended with an ALERT saying the search "down from init_scale" never
  found one. The monitor keeps the scale it took over (saved with its state), and says it.
- At ``global_step`` 0 (a checkpoint saved before any step) the scale was taken over unsaid (the
  resume's warning is given only after a step): it is said as at any other step; a checkpoint of
  no step and no stock scale still begins as a fresh fit, with nothing to say.
- Lightning saves a precision plugin's state under its class's ``__qualname__``: a user's
  ``MixedPrecision`` subclass's GradScaler state is under its own name, and the take-over looked
  only for ``"MixedPrecision"`` (the scale restarted at ``init_scale``). An entry whose keys are a
  GradScaler's is taken over under any name when the named ones are absent; two are refused.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from test_lightning import Digits, fit
from test_lightning_review54m import STOCK, _resumed, _stock_checkpoint

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.precision import SlowPrecisionWarning  # noqa: E402


class MyAMP(MixedPrecision):
    """A user's own fp16 plugin: Lightning keys its state ``"MyAMP"``."""


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


def _at_start(tmp_path, name, plugin):
    """A checkpoint ``plugin``'s fit saves before its first step (``global_step`` 0)."""

    class SaveAtStart(L.Callback):
        def on_train_start(self, trainer, module):
            trainer.save_checkpoint(tmp_path / name)

    fit(Digits(hidden=8), plugin, steps=1, callbacks=[SaveAtStart()])
    assert torch.load(tmp_path / name, weights_only=False)["global_step"] == 0
    return tmp_path / name


def test_a_stock_scale_taken_over_at_global_step_0_is_said_as_at_any_step(tmp_path):
    """The stock state of no step holds its own init_scale (1024) and tracker 0: taken over as at
    any step (the checkpoint's scaler state goes on), and said, the plugin's init_scale 64 set aside
    in plain sight. A step-0 checkpoint without a stock scale (fp32) resumes as a fresh fit, unsaid."""
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **STOCK))
    ckpt = _at_start(tmp_path, "stock-0.ckpt", stock)
    assert torch.load(ckpt, weights_only=False)["MixedPrecision"]["_growth_tracker"] == 0
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler={**STOCK, "init_scale": 64.0}), ckpt, steps=2)
    assert scales == [1024.0, 1024.0]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("AmpGuardPlugin: stock-0.ckpt holds no ampguard state (saved without the plugin): "
                              "steps go on from its global_step 0; the loss scale takes over its GradScaler's scale "
                              "1024 and growth tracker 0 (Lightning's 'MixedPrecision' state)"), said
    plain = _at_start(tmp_path, "fp32-0.ckpt", L.pytorch.plugins.precision.Precision())
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler={"init_scale": 64.0}), plain, steps=2)
    assert scales == [64.0, 64.0] and said == []


def test_a_bf16_fit_says_it_leaves_a_step_0_stock_scale_unused(tmp_path):
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **STOCK))
    scales, said = _resumed(AmpGuardPlugin("bf16-mixed"), _at_start(tmp_path, "stock-0.ckpt", stock), steps=1)
    assert len(said) == 1 and "its MixedPrecision loss scale is not used (this fit is bf16-mixed" in said[0], said


def _subclass_checkpoint(tmp_path):
    """A fit with the user's ``MyAMP``: its GradScaler's state under ``"MyAMP"``, none under
    ``"MixedPrecision"`` (one overflow at step 2: 1024 -> 512, then 2 clean steps)."""
    plugin = MyAMP("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **STOCK))
    fit(Digits(hidden=8, faults=["inf_grad@2"]), plugin, steps=4).save_checkpoint(tmp_path / "mine.ckpt")
    saved = torch.load(tmp_path / "mine.ckpt", weights_only=False)
    assert "MixedPrecision" not in saved and (saved["MyAMP"]["scale"], saved["MyAMP"]["_growth_tracker"]) == (512, 2)
    return tmp_path / "mine.ckpt"


def test_a_mixed_precision_subclass_s_scale_is_taken_over_under_its_own_name(tmp_path):
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler=STOCK), _subclass_checkpoint(tmp_path), steps=7)
    assert scales == [512.0, 512.0, 1024.0]  # (2 clean steps counted before the save, 3 after: grown at step 7)
    assert len(said) == 1 and ("the loss scale takes over its GradScaler's scale 512 and growth tracker 2 "
                               "(Lightning's 'MyAMP' state)") in said[0], said


def test_two_gradscaler_states_of_other_names_are_refused_in_one_line(tmp_path):
    ckpt = _subclass_checkpoint(tmp_path)
    saved = torch.load(ckpt, weights_only=False)
    saved["OtherAMP"] = {**saved["MyAMP"], "scale": 64.0}
    torch.save(saved, ckpt)
    module, plugin = Digits(hidden=8), AmpGuardPlugin("16-mixed", scaler=STOCK)
    with pytest.raises(ValueError) as refused:
        fit(module, plugin, steps=6, ckpt_path=ckpt)
    assert str(refused.value) == (
        "AmpGuardPlugin: mine.ckpt holds GradScaler states under 'MyAMP' and 'OtherAMP', none under "
        "'MixedPrecision': which one is this fit's loss scale cannot be told; delete the entries not to go on "
        "from, or start a new fit without ckpt_path")
    assert plugin.guard is None and list(module.after) == [0]  # (before any step)
    # (a fit with no loss scaler takes neither: nothing to tell apart)
    scales, said = _resumed(AmpGuardPlugin("bf16-mixed"), ckpt, steps=5)
    assert len(said) == 1 and "its MyAMP and OtherAMP loss scales are not used" in said[0], said
