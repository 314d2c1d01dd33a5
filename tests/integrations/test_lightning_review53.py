"""AmpGuardPlugin against review 53d: an ``interval="epoch"`` LR scheduler stepped at the end of
an epoch whose every optimizer step was skipped (the schedule counts what was learned, as a
step scheduler is held per skipped step), and Lightning's own ``self.clip_gradients(...)``
refused in manual optimization with a message that did not say what to do."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F

L = pytest.importorskip("lightning")

from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402


def _data(n=16, batch_size=4):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)


class Tiny(L.LightningModule):
    """A Linear(4, 1) whose optimizer steps in ``nan_at`` (1-based, 4 a epoch) get a NaN loss;
    ``schedule`` is ``"step"``/``"epoch"`` (a StepLR halving the LR) or ``"plateau"`` (a
    ReduceLROnPlateau on a flat metric: every epoch it is stepped after its first is a bad one)."""

    def __init__(self, nan_at=(), schedule="epoch", frequency=1):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.nan_at, self.schedule, self.frequency = set(nan_at), schedule, frequency

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x).float(), y)
        self.log("flat", 1.0, on_step=False, on_epoch=True)
        return loss * float("nan") if self.trainer.global_step + 1 in self.nan_at else loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.schedule == "plateau":
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
            config = {"scheduler": sched, "interval": "epoch", "monitor": "flat", "frequency": self.frequency}
        else:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            config = {"scheduler": sched, "interval": self.schedule, "frequency": self.frequency}
        return {"optimizer": opt, "lr_scheduler": config}


def _fit(module, plugin, epochs):
    trainer = L.Trainer(plugins=[plugin], max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (few workers, a tiny dataset)
        trainer.fit(module, _data())
    return trainer


@pytest.mark.parametrize("nan_at, held", [((1, 2, 3, 4), True), ((1, 2, 4), False), ((), False)])
def test_an_epoch_scheduler_holds_only_when_its_epoch_applied_no_update(nan_at, held):
    # review 53d: a StepLR with interval="epoch" halved the LR after an epoch of 4 skipped steps (0 updates)
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    module = _fit(Tiny(nan_at), plugin, epochs=2).lightning_module
    assert [r.skipped for r in list(plugin.records)[:4]] == [k in nan_at for k in range(1, 5)]
    assert plugin.records[4].lr == (0.1 if held else 0.05)  # the LR epoch 1 ran at
    assert module.lr_schedulers().last_epoch == (1 if held else 2)  # epoch 1 applied updates: it stepped


def test_a_step_scheduler_is_held_per_skipped_step_as_before():
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    module = _fit(Tiny((1, 2, 3, 4), schedule="step"), plugin, epochs=2).lightning_module
    assert [r.lr for r in plugin.records] == [0.1] * 5 + [0.05, 0.025, 0.0125]
    assert module.lr_schedulers().last_epoch == 4  # the 4 applied updates of epoch 1


def test_scheduler_on_skip_step_steps_an_epoch_scheduler_as_lightning_does():
    plugin = AmpGuardPlugin("bf16-mixed", log=False, scheduler_on_skip="step")
    module = _fit(Tiny((1, 2, 3, 4)), plugin, epochs=2).lightning_module
    assert plugin.records[4].lr == 0.05 and module.lr_schedulers().last_epoch == 2


def test_an_epoch_scheduler_with_a_frequency_is_asked_at_lightnings_epochs_and_held_when_that_one_applied_nothing():
    # frequency 2: Lightning asks at the ends of epochs 1 and 3; epoch 1 all skipped holds it there,
    # epoch 3 applied steps it (the epochs between are not counted); the config keeps its frequency
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    trainer = _fit(Tiny((5, 6, 7, 8), frequency=2), plugin, epochs=4)
    assert trainer.lightning_module.lr_schedulers().last_epoch == 1
    assert [r.lr for r in list(plugin.records)[::4]] == [0.1, 0.1, 0.1, 0.1]
    assert trainer.lr_scheduler_configs[0].frequency == 2


def test_a_plateau_epoch_scheduler_is_held_when_its_epoch_applied_nothing():
    # ReduceLROnPlateau on the epoch's metric: not stepped (its metric not taken) after epoch 0, all skipped
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    held = _fit(Tiny((1, 2, 3, 4), schedule="plateau"), plugin, epochs=3).lightning_module.lr_schedulers()
    stepped = _fit(Tiny((1, 2), schedule="plateau"), AmpGuardPlugin("bf16-mixed", log=False),
                   epochs=3).lightning_module.lr_schedulers()
    assert (held.last_epoch, stepped.last_epoch) == (2, 3)
    assert (held.get_last_lr(), stepped.get_last_lr()) == ([0.05], [0.025])  # one bad epoch less seen

class ManualClip(Tiny):
    """Manual optimization with Lightning's documented clipping idiom between backward and step."""

    def __init__(self, algorithm="norm"):
        super().__init__(schedule="none")
        self.automatic_optimization, self.algorithm = False, algorithm

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.mse_loss(self.layer(batch[0]).float(), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm=self.algorithm)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_self_clip_gradients_in_manual_optimization_is_refused_with_the_way_out(tmp_path):
    # review 53d: "gradient_clip_val / clip_gradients must be unset" did not say to drop the call for max_norm=
    plugin = AmpGuardPlugin("bf16-mixed", log=False, csv=tmp_path / "steps.csv")
    with pytest.raises(ValueError) as refused:
        _fit(ManualClip(), plugin, epochs=1)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("AmpGuardPlugin clips to max_norm itself, between unscale and the step")
    assert "remove the self.clip_gradients(...) call from training_step and give the plugin max_norm=0.5" in message
    assert not (tmp_path / "steps.csv").exists() and plugin.guard.updates == 0


def test_a_value_clip_in_manual_optimization_is_refused_naming_no_value_clip():
    with pytest.raises(ValueError, match=r"offers no clipping by value: remove the self\.clip_gradients\(\.\.\.\) "
                                         r"call from training_step"):
        _fit(ManualClip("value"), AmpGuardPlugin("bf16-mixed", log=False), epochs=1)


class ForwardingClip(Tiny):
    """Automatic optimization with a configure_gradient_clipping that clips through Lightning's own call."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


def test_self_clip_gradients_in_configure_gradient_clipping_is_refused_naming_that_hook():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the override's own warning, review 48f)
        with pytest.raises(ValueError, match=r"remove the self\.clip_gradients\(\.\.\.\) call from "
                                             r"configure_gradient_clipping and give the plugin max_norm=0\.5"):
            _fit(ForwardingClip(), AmpGuardPlugin("bf16-mixed", log=False), epochs=1)


def test_an_fp16_plugin_with_its_scaler_turned_off_takes_no_floor_nor_says_one():
    # review 53j: AmpGuardPlugin("16-mixed", scaler={"enabled": False}) added its min_scale floor, then
    # said "scaler settings min_scale ignored", a setting never given
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = AmpGuardPlugin("16-mixed", scaler={"enabled": False})
    assert plugin.scaler_settings == {"enabled": False}
    assert AmpGuardPlugin("16-mixed").scaler_settings == {"min_scale": 1.0}
