"""Review 53i, the Lightning plugin: a crash inside it ended with the Guard's own-loop note ("the
next guard.backward() begins a new step"), though the plugin's users never call the guard."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn import functional as F

L = pytest.importorskip("lightning")

from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402


def _raise(grad):
    raise RuntimeError("a backward hook raised")


def test_a_crash_inside_the_lightning_plugin_has_no_note_for_a_loop_of_ones_own():
    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.layer(x).float()
            if batch_idx == 1:
                out.register_hook(_raise)
            return F.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g),
                                                                      torch.randn(16, 1, generator=g)), batch_size=4)
    trainer = L.Trainer(plugins=[AmpGuardPlugin("bf16-mixed")], max_epochs=1, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False)
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="a backward hook raised") as crashed:
        warnings.simplefilter("ignore")  # (few workers, a tiny dataset)
        trainer.fit(Tiny(), data)
    assert not [n for n in getattr(crashed.value, "__notes__", []) if "guard.backward()" in n]
