"""Review 55n F1: under ``AmpGuardPlugin("16-mixed")`` a gradient edit in ``on_after_backward``
(Lightning's hook that sees the still-scaled gradients) aborted the fit at step 1 with the guard's
refusal of an edit before its unscale, and advice (``guard.unscale_()``) a Lightning user cannot
follow. A mask of rows commutes with the loss scale: the fit is bit for bit Lightning's own
``MixedPrecision``'s, with one ``ScaledEditWarning`` that names the parameter and says where a clip
belongs under Lightning."""

from __future__ import annotations

import warnings

import pytest
import torch

from test_lightning import Digits, fit, same

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from ampguard import ScaledEditWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402


class MaskRows(Digits):
    """The first 4 hidden units frozen by a mask of their gradients' rows."""

    def on_after_backward(self):
        self.net[0].weight.grad[:4] = 0
        self.net[0].bias.grad[:4] = 0


def test_an_on_after_backward_mask_fits_bit_for_bit_lightnings_own_fp16_with_one_warning():
    plain, guarded = MaskRows(hidden=8), MaskRows(hidden=8)
    fit(plain, MixedPrecision("16-mixed", "cpu"), steps=3)
    plugin = AmpGuardPlugin("16-mixed", max_norm=None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(guarded, plugin, steps=3)
    said = [str(w.message) for w in seen if issubclass(w.category, ScaledEditWarning)]
    assert len(said) == 1 and said[0].startswith("Guard.unscale_(): the gradient of parameter 'net.0.weight' was "
                                                 "changed after guard.backward() (under Lightning: in "
                                                 "on_after_backward), while the loss scale (65536) still multiplied "
                                                 "it. A mask or another multiplication there is fine"), said
    assert "max_norm= (the plugin's, under Lightning)" in said[0] and "on_before_optimizer_step" in said[0]
    assert len(plugin.records) == 3 and not any(r.skipped for r in plugin.records)
    assert same(guarded.after[3], plain.after[3])
    assert torch.equal(guarded.after[3][0][:4], guarded.after[0][0][:4])  # the masked rows never moved
