"""GuardedTrainer against review 53g, in a real Hugging Face Trainer (a tiny GPT-2 on the CPU):
an epoch's short last group (HF's own group size, which the guard takes) says nothing of the
``ShortGroupWarning`` a loop's early ``unscale_()`` gets; the scaler settings are said ignored
under bf16 only when the user gave them, once a run."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from ampguard.errors import AmpguardWarning  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402
from ampguard.step import ShortGroupWarning  # noqa: E402


def _run(tmp_path, precision, **extra):
    """28 sequences in batches of 4: 7 batches an epoch, so with GA 3 HF steps after batches 3, 6
    and 7 (a group of one). The AmpguardWarnings said from the trainer's making to its end."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    g = torch.Generator().manual_seed(0)
    ids = (torch.randint(0, 32, (28, 1), generator=g) + torch.arange(8)) % 32
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1, use_cpu=True,
                             report_to=[], save_strategy="no", gradient_accumulation_steps=3, disable_tqdm=True,
                             bf16=precision == "bf16", fp16=precision == "fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GuardedTrainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                 ampguard=AmpGuardCallback(print_fn=lambda line: None), **extra)
        trainer.train()
    return trainer, [w for w in caught if issubclass(w.category, AmpguardWarning)]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_an_epochs_short_last_group_and_the_default_scaler_settings_say_nothing(tmp_path, precision):
    trainer, said = _run(tmp_path, precision)
    assert trainer.state.global_step == 3 and trainer.guard.updates == 3  # the third a group of one
    assert not [str(w.message) for w in said
                if issubclass(w.category, ShortGroupWarning) or "loss scaler" in str(w.message)]


def test_scaler_settings_given_under_bf16_are_said_once_a_run(tmp_path):
    trainer, said = _run(tmp_path, "bf16", scaler={"init_scale": 4.0, "growth_interval": 10})
    assert trainer.state.global_step == 3
    assert [str(w.message) for w in said if "loss scaler" in str(w.message)] == [
        "precision bf16 uses no loss scaler: scaler settings init_scale, growth_interval ignored"]
