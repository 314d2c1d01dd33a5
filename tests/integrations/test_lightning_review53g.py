"""AmpGuardPlugin against review 53g, in real Lightning fits: an epoch's short last group (the
plugin unscales before Lightning's hooks, then closes the group itself, ``close=True``) says
nothing of the ``ShortGroupWarning`` a loop's early ``unscale_()`` gets; the plugin's scaler
settings are said ignored under bf16 only when the user gave them, once a fit."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F

L = pytest.importorskip("lightning")

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.step import ShortGroupWarning  # noqa: E402


def _data(n=40, batch_size=4):  # 10 batches an epoch: groups of 4 are 4, 4 and the short 2
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class Tiny(L.LightningModule):
    """A Linear(4, 1); its ``on_before_optimizer_step`` notes the gradient norm Lightning's hooks
    see (so the plugin unscales before them, under bf16 too)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.norms = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x).float(), y)

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(float(self.layer.weight.grad.norm()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(module, plugin, epochs=1, **trainer_args):
    trainer = L.Trainer(plugins=[plugin], max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        **trainer_args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _data())
    return trainer, [w for w in caught if issubclass(w.category, AmpguardWarning)]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_an_epochs_short_last_group_closes_with_no_short_group_warning(precision):
    module = Tiny()
    plugin = AmpGuardPlugin(precision)
    trainer, said = _fit(module, plugin, accumulate_grad_batches=4)
    assert trainer.global_step == 3 and [r.step for r in plugin.records] == [1, 2, 3]
    assert len(module.norms) == 3 and plugin.guard.updates == 3  # the hooks ran, the short group stepped
    assert not [str(w.message) for w in said if issubclass(w.category, ShortGroupWarning)]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
def test_the_plugins_default_scaler_settings_say_nothing(precision):
    # (16-mixed fills in min_scale 1.0 itself: not the user's, never said)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        plugin = AmpGuardPlugin(precision)
    trainer, said = _fit(Tiny(), plugin)
    assert trainer.global_step == 10
    assert not [str(w.message) for w in said if "loss scaler" in str(w.message)]


def test_scaler_settings_given_under_bf16_are_said_once_a_fit():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = AmpGuardPlugin("bf16-mixed", scaler={"init_scale": 4.0})
    _, during = _fit(Tiny(), plugin)
    said = [str(w.message) for w in [*caught, *during] if "loss scaler" in str(w.message)]
    assert said == ["precision bf16 uses no loss scaler: scaler settings init_scale ignored"]
