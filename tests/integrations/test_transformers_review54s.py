"""Review 54s: a stock fp16 ``transformers.Trainer`` checkpoint resumed with ``GuardedTrainer``.

HF's ``Trainer._save_scaler`` saves Accelerate's GradScaler's ``state_dict()`` as ``scaler.pt``
in each ``checkpoint-N``. GuardedTrainer took its scale alone (review 37c): the count of clean
steps restarted at 0, so the scale grew ``growth_interval`` steps late; settings that differ
from the checkpoint's were kept unsaid; a non-finite scale restarted at ``init_scale``. It now
takes the scale and the growth tracker over as the Lightning plugin does (one function,
``precision.take_over_stock_scale``), refuses a state ``check_state`` refuses, and names the
settings it keeps. Accelerate makes no GradScaler on a CPU (``mixed_precision="fp16"`` there
scales nothing, so a stock CPU run saves no ``scaler.pt``): the file is written here by HF's own
``_save_scaler`` from a real CPU GradScaler that ran an overflow and two clean steps, the state
a GPU run saves (same keys, same shape).
"""

from __future__ import annotations

import pytest
import torch

from test_transformers_review import arguments, events, stock_checkpoint, tiny_gpt2, token_ids

transformers = pytest.importorskip("transformers")
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import Trainer  # noqa: E402

from helpers import read_rows  # noqa: E402
from ampguard.errors import InputError  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def _stock_scaler_pt(tmp_path, checkpoint: str, scale: float | None = None) -> None:
    """``checkpoint``'s ``scaler.pt`` as HF's ``_save_scaler`` writes it: a GradScaler (init 1024,
    growth_interval 5) after an overflow (1024 -> 512) and 2 clean steps."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for grad in (float("inf"), 1.0, 1.0):
        scaler.scale((weight * grad).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    state = scaler.state_dict()
    assert (state["scale"], state["_growth_tracker"]) == (512.0, 2)
    stock = Trainer(model=tiny_gpt2(), args=arguments(tmp_path / "stock", "fp16"))
    stock.accelerator.scaler = scaler if scale is None else None  # (the CPU Accelerator has none of its own)
    if scale is None:
        stock._save_scaler(checkpoint)  # HF's own save: torch.save(accelerator.scaler.state_dict(), scaler.pt)
    else:
        torch.save({**state, "scale": scale}, f"{checkpoint}/scaler.pt")
    AcceleratorState._reset_state(reset_partial_state=True)


def _resume(tmp_path, checkpoint: str, steps: int, **scaler) -> tuple[list[tuple[str, str]], str]:
    GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", max_steps=steps), train_dataset=token_ids(200),
                   scaler=scaler or None, ampguard=AmpGuardCallback(print_fn=lambda line: None)
                   ).train(resume_from_checkpoint=checkpoint)
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    return ([(r["skipped"], r["scaler_scale"]) for r in rows],
            next(e for e in events(tmp_path) if e["event"] == "resume")["message"])


def test_a_stock_scaler_pt_s_scale_and_growth_tracker_are_taken_over(tmp_path):
    """The stock run's settings given: steps 3 and 4 at 512, grown at step 5 (2 clean steps
    counted before the save, 3 after), as the stock scaler would have; it grew at step 7."""
    checkpoint = stock_checkpoint(tmp_path, 2, 2)
    _stock_scaler_pt(tmp_path, checkpoint)
    rows, said = _resume(tmp_path, checkpoint, 5, init_scale=1024.0, growth_interval=5)
    assert rows == [("0", "512.0"), ("0", "512.0"), ("0", "1024.0")]
    assert ("the loss scale takes over its scaler.pt (the stock Trainer's GradScaler's): scale 512 and growth "
            "tracker 2; the monitor observes") in said, said
    assert "\n" not in said


@pytest.mark.parametrize("interval, tracker", [(2000, 2), (2, 0)])
def test_guarded_trainer_s_own_scaler_settings_are_kept_and_said(tmp_path, interval, tracker):
    checkpoint = stock_checkpoint(tmp_path, 2, 2)
    _stock_scaler_pt(tmp_path, checkpoint)
    rows, said = _resume(tmp_path, checkpoint, 3, **({} if interval == 2000 else {"growth_interval": interval}))
    assert rows == [("0", "512.0")]
    assert (f"scale 512 and growth tracker {tracker}" + (
        " (the checkpoint's 2 clean steps reach GuardedTrainer's growth_interval 2: the count restarts at 0)"
        if tracker == 0 else "") + f"; GuardedTrainer's scaler settings kept (growth_interval {interval}, the "
            "checkpoint's 5); the monitor") in said, said


def test_a_stock_scaler_pt_that_check_state_refuses_is_refused_before_anything_is_written(tmp_path):
    """A NaN scale restarted at init_scale, said only in the resume event; a state the scaler
    cannot take is refused in one line naming the file, as the Lightning plugin refuses one."""
    checkpoint = stock_checkpoint(tmp_path, 2, 2)
    _stock_scaler_pt(tmp_path, checkpoint, scale=float("nan"))
    with pytest.raises(InputError, match=r"^\S+checkpoint-2/scaler\.pt: not a loss scale to go on from: scale is nan, "
                                         r"expected a number in \[0, "):
        _resume(tmp_path, checkpoint, 4)
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()
