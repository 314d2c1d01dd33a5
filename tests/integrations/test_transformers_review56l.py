"""Review 56l F3: GuardedTrainer's strict-JSON ``ampguard_state.json`` wrote every non-finite float
as a string, but read them back as floats only in the monitor's last record and held-out metrics:
a monitor of the user's on the guard whose ``best`` was inf came back the string ``"inf"``, and its
first comparison after the resume raised ``TypeError`` mid-training."""

from __future__ import annotations

import json
import math

import pytest

from test_transformers_review import arguments, tiny_gpt2, token_ids

pytest.importorskip("transformers")
from transformers import TrainerCallback  # noqa: E402

from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


class _Lowest:
    """A user's monitor on the guard: the lowest loss so far (inf before any), beside a genuine string."""

    def __init__(self) -> None:
        self.best, self.label = math.inf, "inf"

    def state_dict(self) -> dict:
        return {"best": self.best, "label": self.label}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.label = state["best"], state["label"]


class _Registers(TrainerCallback):
    """Registers ``_Lowest`` on the trainer's guard at the first step's end (the guard is built by then;
    on a resume, from the checkpoint, whose saved state the monitor then gets)."""

    def __init__(self) -> None:
        self.trainer: GuardedTrainer | None = None
        self.monitor = _Lowest()

    def on_step_end(self, args, state, control, **kwargs):
        if "lowest" not in self.trainer.guard.monitors:
            self.trainer.guard.monitors["lowest"] = self.monitor


def _trainer(tmp_path, steps: int, registers: _Registers, **extra) -> GuardedTrainer:
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", max_steps=steps, **extra),
                             train_dataset=token_ids(), ampguard=AmpGuardCallback(print_fn=lambda line: None),
                             callbacks=[registers])
    registers.trainer = trainer
    return trainer


def test_a_monitor_on_the_guard_at_inf_resumes_at_inf_and_a_string_of_its_stays_a_string(tmp_path):
    _trainer(tmp_path, 2, _Registers(), save_strategy="steps", save_steps=2).train()
    text = (tmp_path / "out" / "checkpoint-2" / "ampguard_state.json").read_text(encoding="utf-8")
    assert json.loads(text)["guard"]["monitors"]["lowest"] == {"best": "inf", "label": "inf"}  # (strict JSON)
    resumed = _Registers()
    resumed.monitor.best, resumed.monitor.label = 0.0, "fresh"  # (what the resume must replace)
    _trainer(tmp_path, 3, resumed).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    best = resumed.monitor.best
    assert isinstance(best, float) and best == math.inf  # (was the string "inf": min(best, loss) raised)
    assert resumed.monitor.label == "inf"  # (the user's string: no number)
