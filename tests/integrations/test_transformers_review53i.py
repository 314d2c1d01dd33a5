"""Review 53i, the Hugging Face adapter: since 5eb7128 GuardedTrainer put
an applied step's gradients back right after the guard's step, so a callback that only measured
them in ``on_pre_optimizer_step`` (``clip_grad_norm_(params, inf)`` multiplies them in place by
1.0) was refused as "a backward of your own" (it trained before, and under the stock Trainer);
the refusal of a real backward after the step said HF would apply those gradients (its
optimizer step after the guard's does nothing: they would be dropped); and a crash inside it
ended with the Guard's own-loop note ("the next guard.backward() begins a new step"), though its
users never call the guard. A one-layer GPT-2 from a GPT2Config, on the CPU."""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments)

from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))


def _ids():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (16, 8), generator=g)]


def _args(tmp_path, name: str, steps: int, **extra) -> TrainingArguments:
    return TrainingArguments(str(tmp_path / name), **{**dict(
        per_device_train_batch_size=4, max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=1e-3, bf16=True, seed=0), **extra})


def _quiet() -> AmpGuardCallback:
    return AmpGuardCallback(print_fn=lambda line: None)


class NormMonitor(TrainerCallback):
    """HF's "useful for monitoring gradients" hook, measuring the norm as many do: torch's
    ``clip_grad_norm_`` with ``inf`` (it multiplies each gradient in place by the clamp, 1.0)."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        params = [p for p in model.parameters() if p.grad is not None]
        if params:
            self.norms.append(float(torch.nn.utils.clip_grad_norm_(params, float("inf"))))


def test_a_callback_measuring_the_gradients_in_place_before_hfs_step_trains_as_the_stock_trainer(tmp_path):
    # it was refused at step 1: "gradients made after the guarded step (a backward of your own ...)"
    runs = {}
    for name, cls, extra in (("stock", Trainer, {}), ("guarded", GuardedTrainer, {"ampguard": _quiet()})):
        model, monitor = _model(), NormMonitor()
        cls(model=model, args=_args(tmp_path, name, 3), train_dataset=_ids(), callbacks=[monitor], **extra).train()
        runs[name] = (monitor.norms, [p.detach().clone() for p in model.parameters()])
    assert len(runs["stock"][0]) == 3 and runs["guarded"][0] == []  # the guard's step comes first: it sees none
    assert all(torch.equal(a, b) for a, b in zip(runs["stock"][1], runs["guarded"][1]))  # bit for bit


def test_a_backward_of_ones_own_after_the_step_is_refused_saying_its_gradients_would_be_dropped(tmp_path):
    # the refusal said HF's optimizer step would apply them; it does nothing after the guard's, and
    # HF's model.zero_grad() drops them: that loss would silently not train
    class Aux(GuardedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            sum(p.float().square().sum() for p in model.parameters()).backward()
            return loss

    model = _model()
    trainer = Aux(model=model, args=_args(tmp_path, "out", 2), train_dataset=_ids(), ampguard=_quiet())
    with pytest.raises(RuntimeError) as refused:
        trainer.train()
    said = str(refused.value)
    assert re.match(r"^GuardedTrainer: gradients made after the guarded step \(a backward of your own after "
                    r"super\(\)\.training_step\(\.\.\.\)\) would never be applied: ", said), said
    assert "HF's model.zero_grad() drops them" in said and "\n" not in said
    assert "would be applied" not in said
    assert trainer.guard.updates == 1


def test_a_crash_inside_guardedtrainer_has_no_note_for_a_loop_of_ones_own(tmp_path):
    # "the next guard.backward() begins a new step": the user of GuardedTrainer never calls the guard
    model = _model()
    calls = []

    def boom(module, grad_in, grad_out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a backward hook raised")

    model.lm_head.register_full_backward_hook(boom)
    trainer = GuardedTrainer(model=model, args=_args(tmp_path, "out", 3), train_dataset=_ids(), ampguard=_quiet())
    with pytest.raises(RuntimeError, match="a backward hook raised") as crashed:
        trainer.train()
    assert not [n for n in getattr(crashed.value, "__notes__", []) if "guard.backward()" in n]
    assert trainer.guard.updates == 1
