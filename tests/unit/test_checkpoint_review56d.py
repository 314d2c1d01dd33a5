"""Review 56d F4: arriving from plain PyTorch. A plain state_dict given to ``--checkpoint`` met
"not an ampguard checkpoint" with no way forward; a hand-built guard state without ``precision``
was refused as "saved with precision=None", which reads as a precision mismatch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from helpers import one_error_line

from ampguard import Guard
from ampguard import checkpoint as ckpt
from ampguard.errors import InputError

pytestmark = pytest.mark.usefixtures("_one_thread")  # tests/conftest.py


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_a_hand_built_guard_state_is_refused_naming_what_it_lacks():
    model, opt = _build()
    plain = torch.amp.GradScaler("cpu", init_scale=512.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard = Guard(model, opt, precision="fp16")
    with pytest.raises(ValueError) as err:
        guard.load_state_dict({"scaler": plain.state_dict(), "step": 100, "updates": 97})
    assert str(err.value) == (
        "Guard.load_state_dict(): the state has no precision, accumulation_steps (its keys: scaler, step, updates): "
        "not what Guard.state_dict() returned; a plain GradScaler's state goes to guard.scaler.load_state_dict(), or "
        "hand the GradScaler itself over as Guard(scaler=...)")
    assert guard.steps == 0 and guard.scaler.get_scale() == 2.0**16  # (nothing restored)
    guard.scaler.load_state_dict(plain.state_dict())  # (the way it names)
    assert guard.scaler.get_scale() == 512.0


WAY_ON = "not an ampguard checkpoint (a plain PyTorch state_dict? load it into the model in your task.factory's build)"


def test_a_plain_state_dict_as_a_checkpoint_is_refused_with_the_way_on(tmp_path, cli):
    model, opt = _build()
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "both.pt")
    for name in ("plain.pt", "both.pt"):
        with pytest.raises(InputError) as err:
            ckpt.load_checkpoint(tmp_path / name)
        assert str(err.value) == f"{tmp_path / name}: {WAY_ON}"
    line = one_error_line(cli("validate", "--set", "task.name=linear", "--checkpoint", tmp_path / "plain.pt",
                              "--out", "r"))
    assert line.endswith(f"plain.pt: {WAY_ON}") and not (tmp_path / "r").exists()
