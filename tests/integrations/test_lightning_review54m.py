"""Review 54m, the Lightning plugin and Lightning's own ``MixedPrecision`` checkpoints.

A fit with Lightning's stock fp16 plugin saves its GradScaler's ``state_dict()`` under the
checkpoint's ``"MixedPrecision"`` key (Lightning 1.x: ``"native_amp_scaling_state"``). Resumed
with ``AmpGuardPlugin("16-mixed")``, the loss scale restarted at ``init_scale`` (65536 by
default), throwing away the scale the stock run had found: a run whose scale had settled low
skipped its first resumed steps again. Now the plugin takes the scale and the growth tracker
over (its own settings kept, said when they differ), or refuses a state that is not one. The
stock plugin is made on the CPU as a user makes it (``plugins=[MixedPrecision("16-mixed",
"cpu")]``: the Trainer's ``precision="16-mixed"`` flag falls back to bf16 on a CPU); its
checkpoint's scaler state has the same keys and shape as on CUDA (``GradScaler.state_dict()``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from test_lightning import Digits, fit

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.precision import SlowPrecisionWarning  # noqa: E402

STOCK = {"init_scale": 1024.0, "growth_interval": 5}


def _stock_checkpoint(path, steps=4):
    """A stock fp16 fit's checkpoint: one overflow at step 2 (1024 -> 512), then 2 clean steps
    counted towards growth_interval 5."""
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **STOCK))
    fit(Digits(hidden=8, faults=["inf_grad@2"]), stock, steps=steps).save_checkpoint(path)
    state = torch.load(path, weights_only=False)["MixedPrecision"]
    assert (state["scale"], state["_growth_tracker"], state["growth_interval"]) == (512.0, 2, 5)
    return path


def _resumed(plugin, ckpt, steps=7):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(Digits(hidden=8), plugin, steps=steps, ckpt_path=ckpt)
    said = [str(w.message) for w in seen  # (fp16 on a CPU is warned slow: not this test's)
            if issubclass(w.category, AmpguardWarning) and not issubclass(w.category, SlowPrecisionWarning)]
    return [float(r.scaler_scale) for r in plugin.records], said


def test_a_stock_fp16_checkpoint_s_scale_and_growth_tracker_are_taken_over(tmp_path):
    """The resumed scale goes on as an ampguard run with the stock run's settings does: 512 at
    steps 5 and 6, grown to 1024 at step 7 (the 2 clean steps counted before the save, 3 after)."""
    through = AmpGuardPlugin("16-mixed", scaler=STOCK)
    fit(Digits(hidden=8, faults=["inf_grad@2"]), through, steps=7)
    resumed = AmpGuardPlugin("16-mixed", scaler=STOCK)
    scales, said = _resumed(resumed, _stock_checkpoint(tmp_path / "stock.ckpt"))
    assert scales == [float(r.scaler_scale) for r in through.records][4:] == [512.0, 512.0, 1024.0]
    assert len(said) == 1 and "\n" not in said[0]
    assert "takes over its GradScaler's scale 512 and growth tracker 2" in said[0], said
    assert "starts again" not in said[0] and "settings" not in said[0]


def test_lightning_1x_native_amp_scaling_state_is_taken_over_too(tmp_path):
    ckpt = _stock_checkpoint(tmp_path / "stock.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    saved["native_amp_scaling_state"] = saved.pop("MixedPrecision")
    torch.save(saved, ckpt)
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler=STOCK), ckpt, steps=5)
    assert scales == [512.0] and "takes over its GradScaler's scale 512" in said[0]


@pytest.mark.parametrize("interval, tracker", [(3, 2), (2, 0)])
def test_the_plugin_s_own_scaler_settings_are_kept_and_said(tmp_path, interval, tracker):
    """growth_interval 3: the 2 clean steps stand (the scale grows at step 5); 2: a count of 2 is
    past it (PyTorch grows only when the count reaches the interval: it would never grow), so the
    count restarts at 0, said."""
    plugin = AmpGuardPlugin("16-mixed", scaler={"init_scale": 1024.0, "growth_interval": interval})
    scales, said = _resumed(plugin, _stock_checkpoint(tmp_path / "stock.ckpt"), steps=6)
    assert scales == ([1024.0, 1024.0] if interval == 3 else [512.0, 1024.0])
    assert len(said) == 1 and f"growth tracker {tracker}" in said[0], said
    assert f"this plugin's scaler settings kept (growth_interval {interval}, the checkpoint's 5)" in said[0]
    assert ("restarts at 0" in said[0]) == (tracker == 0)


def test_a_stock_scaler_state_that_is_not_one_is_refused_before_any_step(tmp_path):
    ckpt = _stock_checkpoint(tmp_path / "stock.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    saved["MixedPrecision"]["scale"] = float("nan")
    torch.save(saved, ckpt)
    module, plugin = Digits(hidden=8), AmpGuardPlugin("16-mixed")
    with pytest.raises(ValueError, match=r"^AmpGuardPlugin: the GradScaler state under .MixedPrecision. in stock\.ckpt "
                                         r"cannot be taken over: scale is nan, expected"):
        fit(module, plugin, steps=6, ckpt_path=ckpt)
    assert plugin.guard is None and list(module.after) == [0]


def test_a_bf16_fit_says_it_leaves_a_stock_fp16_checkpoint_s_scale(tmp_path):
    scales, said = _resumed(AmpGuardPlugin("bf16-mixed"), _stock_checkpoint(tmp_path / "stock.ckpt"), steps=5)
    assert len(said) == 1 and "its MixedPrecision loss scale is not used (this fit is bf16-mixed" in said[0], said


def test_a_stock_bf16_checkpoint_still_starts_the_fp16_scale_afresh(tmp_path):
    fit(Digits(hidden=8), MixedPrecision("bf16-mixed", "cpu"), steps=2).save_checkpoint(tmp_path / "bf16.ckpt")
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler={"init_scale": 64.0}), tmp_path / "bf16.ckpt", steps=3)
    assert scales == [64.0] and "the loss scale starts again at init_scale" in said[0]


def test_the_stock_plugin_resumes_an_fp16_plugin_checkpoint_s_scale(tmp_path):
    """The reverse: the plugin's checkpoint also carries its scale under ``"MixedPrecision"``, in
    GradScaler's own shape, which Lightning's stock plugin loads (it restarted at 65536)."""
    trainer = fit(Digits(hidden=8, faults=["inf_grad@2"]), AmpGuardPlugin("16-mixed", scaler=STOCK), steps=4)
    trainer.save_checkpoint(tmp_path / "ag.ckpt")
    stock = MixedPrecision("16-mixed", "cpu")
    fit(Digits(hidden=8), stock, steps=4, ckpt_path=tmp_path / "ag.ckpt")  # (loaded; no step)
    assert stock.scaler.state_dict() == {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                         "growth_interval": 5, "_growth_tracker": 2}
    again = AmpGuardPlugin("16-mixed", scaler=STOCK)  # (and the plugin still takes its own state)
    scales, said = _resumed(again, tmp_path / "ag.ckpt", steps=7)
    assert scales == [512.0, 512.0, 1024.0] and said == []


def test_a_save_before_the_first_step_keeps_a_stock_scale_not_yet_taken_over(tmp_path):
    """Saved at the resumed fit's start (the guard not yet built: ampguard's state is
    ``before_first_step``), the stock scale is carried on under ``"MixedPrecision"``, and a
    resume from that checkpoint takes it over as from the stock one."""

    class SaveAtStart(L.Callback):
        def on_train_start(self, trainer, module):
            trainer.save_checkpoint(tmp_path / "at-start.ckpt")

    ckpt = _stock_checkpoint(tmp_path / "stock.ckpt")
    fit(Digits(hidden=8), AmpGuardPlugin("16-mixed", scaler=STOCK), steps=5, ckpt_path=ckpt, callbacks=[SaveAtStart()])
    saved = torch.load(tmp_path / "at-start.ckpt", weights_only=False)
    assert saved["AmpGuardPlugin"].get("before_first_step") and saved["MixedPrecision"]["scale"] == 512.0
    scales, said = _resumed(AmpGuardPlugin("16-mixed", scaler=STOCK), tmp_path / "at-start.ckpt", steps=5)
    assert scales == [512.0] and "takes over its GradScaler's scale 512 and growth tracker 2" in said[0]
