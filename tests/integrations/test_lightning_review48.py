"""The Lightning plugin without a loss scaler runs ``guard.unscale_()`` (PyTorch's non-finite
check by 1.0) before Lightning's ``on_before_optimizer_step`` hooks only when one exists: with
none the step's own check sees the same gradients, and that pass over them was a few percent of
a small model's step. With one, a hook that clamps an inf gradient still leaves the step skipped."""

from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning")

from test_lightning import Digits, fit  # noqa: E402

from ampguard.integrations.lightning import AmpGuardPlugin, _hooks_see_gradients  # noqa: E402


class Clamp(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        for p in module.parameters():
            p.grad.nan_to_num_(posinf=0.0, neginf=0.0)


class ClampingDigits(Digits):
    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            p.grad.nan_to_num_(posinf=0.0, neginf=0.0)


class ValueClippingDigits(Digits):  # (review 48e: a clip of one's own here made the inf finite, and the step applied)
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_value_(self.parameters(), 1.0)


class OwnClipGradients(Digits):  # (review 48f: the default configure_gradient_clipping calls it every step)
    def clip_gradients(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        torch.nn.utils.clip_grad_value_(self.parameters(), 1.0)


@pytest.mark.parametrize("hook", ["none", "callback", "module", "instance", "clipping", "clip_gradients"])
def test_an_inf_gradient_skips_its_step_whether_or_not_a_hook_clamps_it_first(hook):
    made = {"module": ClampingDigits, "clipping": ValueClippingDigits, "clip_gradients": OwnClipGradients}.get(
        hook, Digits)
    module = made(faults=["inf_grad@2"])
    if hook == "instance":  # (a hook set on the module itself, not its class)
        module.on_before_optimizer_step = lambda optimizer: [p.grad.nan_to_num_(posinf=0.0, neginf=0.0)
                                                             for p in module.parameters()]
    plugin = AmpGuardPlugin("bf16-mixed", max_norm=1.0)
    trainer = fit(module, plugin, steps=3, callbacks=[Clamp()] if hook == "callback" else [])
    assert [(r.step, r.reason) for r in plugin.records] == [(1, None), (2, "non_finite_grad"), (3, None)]
    assert all(torch.equal(a, b) for a, b in zip(module.after[1], module.after[2]))  # step 2 left them
    assert _hooks_see_gradients(module) is (hook != "none")
    assert trainer.global_step == 3


def test_a_clip_gradients_override_is_warned_as_a_configure_gradient_clipping_one_is():
    # (review 48g: a norm clip in clip_gradients hid the pre-clip norm, unsaid)
    from ampguard.errors import AmpguardWarning

    with pytest.warns(AmpguardWarning, match=r"AmpGuardPlugin: OwnClipGradients\.clip_gradients is overridden; Lightning "
                                             r"runs it before the guard's step"):
        fit(OwnClipGradients(), AmpGuardPlugin("bf16-mixed", max_norm=1.0), steps=1)
