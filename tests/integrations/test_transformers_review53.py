"""Review 53c, the Hugging Face adapter: a transformers too old for GuardedTrainer's seams is
refused when it is built (it crashed at the first step, or past that trained with HF's logged
grad_norm 0.0 and Accelerate autocasting a second time), an Accelerate without the skip flag the
scheduler's hold reads is refused at the first step, and HF's Adafactor recipe
(``relative_step=True`` + ``AdafactorSchedule``) logs its real learning rate (it logged 0.0 at
every step: its schedule reads the gradients the guard had dropped). A one-layer GPT-2 from a
GPT2Config, on the CPU.

And review 53i (below): since 5eb7128 GuardedTrainer put an applied step's gradients back right
after the guard's step, so a callback that only measured them in ``on_pre_optimizer_step``
(``clip_grad_norm_(params, inf)`` multiplies them in place by 1.0) was refused as "a backward of
your own"; the refusal of a real backward after the step said HF would apply those gradients (its
optimizer step after the guard's does nothing: they would be dropped); and a crash inside it ended
with the Guard's own-loop note, though its users never call the guard."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from helpers import read_rows

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.optimization import Adafactor, AdafactorSchedule  # noqa: E402

from ampguard.integrations import transformers as integration  # noqa: E402
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


# ------------------------------------------------------------------ the transformers floor

@pytest.mark.parametrize("seam", ["loss_is_scaled_for_ga", "_clip_grad_norm"])
def test_a_trainer_without_a_seam_the_guard_relies_on_is_refused_when_built(tmp_path, monkeypatch, seam):
    # transformers 4.57 and 5.18 have no loss_is_scaled_for_ga (an AttributeError at the first step),
    # 4.57 no _clip_grad_norm (never called: HF's logged grad_norm 0.0, silently); here the installed
    # Trainer with the name taken off, as an older one is
    monkeypatch.delattr(Trainer, seam)
    with pytest.raises(ImportError) as refused:
        GuardedTrainer(model=_model(), args=_args(tmp_path, "out", 1), train_dataset=_ids(), ampguard=_quiet())
    said = str(refused.value)
    assert "\n" not in said
    assert re.match(rf"GuardedTrainer needs transformers>={re.escape(integration.TRANSFORMERS_FLOOR)} \(this is "
                    rf"{re.escape(transformers.__version__)}: its Trainer has no {seam}\b", said), said
    assert not (tmp_path / "out").exists()  # refused before anything is made


def test_the_installed_transformers_has_every_seam_and_the_floor_is_the_extras():
    assert integration.missing_seams(Trainer) == []
    from pathlib import Path
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"transformers>={integration.TRANSFORMERS_FLOOR}"' in pyproject  # the extra says what the code needs


def test_an_accelerate_without_the_skip_flag_is_refused_at_the_first_step(tmp_path):
    # the guard holds HF's scheduler on a skip through AcceleratedOptimizer._is_overflow (what
    # optimizer_step_was_skipped reads); an Accelerate without it would step the scheduler on every
    # skip, unsaid. Here the prepared optimizer has it taken off, as such an Accelerate's would lack it
    class NoFlag(GuardedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            vars(self.optimizer).pop("_is_overflow", None)
            return super().training_step(model, inputs, num_items_in_batch)

    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = NoFlag(model=model, args=_args(tmp_path, "out", 2), train_dataset=_ids(), ampguard=_quiet())
    with pytest.raises(ImportError, match=r"^GuardedTrainer: this Accelerate \(.*\) has no AcceleratedOptimizer"
                                          r"\._is_overflow"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # no step was taken


# ------------------------------------------------------------------ Adafactor's schedule

def test_adafactor_relative_step_logs_its_real_lr_and_trains_as_the_stock_trainer(tmp_path):
    # AdafactorSchedule reads the lr from the parameters that hold a gradient; the guard dropped
    # them before HF's lr_scheduler.step(), so it wrote its base lr, 0.0, at every step: HF's logged
    # learning_rate and the CSV's lr were 0.0 while the stock Trainer's rose
    runs = {}
    for name, cls, extra in (("stock", Trainer, {}), ("guarded", GuardedTrainer, {"ampguard": _quiet()})):
        model = _model()
        opt = Adafactor(model.parameters(), scale_parameter=True, relative_step=True, warmup_init=True, lr=None)
        trainer = cls(model=model, args=_args(tmp_path, name, 3), train_dataset=_ids(),
                      optimizers=(opt, AdafactorSchedule(opt)), **extra)
        trainer.train()
        runs[name] = ([h["learning_rate"] for h in trainer.state.log_history if "loss" in h],
                      [p.detach().clone() for p in model.parameters()])
    logged = runs["guarded"][0]
    assert logged == runs["stock"][0] and logged[0] == 0.0 < logged[1] < logged[2]  # its warm-up, as stock
    assert [float(r["lr"]) for r in read_rows(tmp_path / "guarded" / "ampguard" / "steps.csv")] == \
        pytest.approx(logged, rel=1e-6)  # the lr each step used (HF logs it before the scheduler's step)
    assert all(torch.equal(a, b) for a, b in zip(runs["stock"][1], runs["guarded"][1]))  # bit for bit


def test_after_an_applied_step_hf_sees_the_applied_gradients_until_its_zero_grad(tmp_path):
    # what HF's loop finds between the guard's step and model.zero_grad(): HF's optimizer.step()
    # (the guard's no-op) puts the applied (clipped) gradients back, so its scheduler and an
    # on_optimizer_step callback see them, as the stock Trainer leaves them; an on_pre_optimizer_step
    # callback, before that call, sees none (review 53i: 5eb7128 put them back before it, and a
    # callback measuring them in place was refused as a backward); none after a skipped step
    # (DESIGN: a skip drops them)
    from transformers import TrainerCallback

    seen = {"pre": [], "post": []}

    class Look(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen["pre"].append([p.grad is not None for p in model.parameters()])

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = [p.grad for p in model.parameters()]
            seen["post"].append([g is not None for g in grads])
            if all(g is not None for g in grads):  # (the applied ones: clipped to max_grad_norm)
                assert float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) == \
                    pytest.approx(0.01, rel=1e-3)

    class NanAtTwo(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            return loss * float("nan") if self.state.global_step == 1 else loss

    trainer = NanAtTwo(model=_model(), args=_args(tmp_path, "out", 3, max_grad_norm=0.01), train_dataset=_ids(),
                       ampguard=_quiet(), callbacks=[Look()])
    trainer.train()
    assert [any(s) for s in seen["pre"]] == [False, False, False]
    assert [all(s) for s in seen["post"]] == [True, False, True]
    assert [any(s) for s in seen["post"]] == [True, False, True]
    assert all(p.grad is None for p in trainer.model.parameters())  # HF's model.zero_grad() dropped them
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert [r["skip_reason"] for r in rows] == ["", "non_finite_loss", ""]


# ------------------------------------------------------------------ a model held in bf16

def test_a_model_held_in_bf16_is_refused_at_the_first_step_as_the_readmes_hf_section_says(tmp_path):
    # from_pretrained(dtype=torch.bfloat16) (or "auto" on a bf16 checkpoint) with bf16=True: the stock
    # Trainer trains it, GuardedTrainer refuses it at the first step; the README's HF section said
    # "use it where you use Trainer" and nothing of this
    model = _model().to(torch.bfloat16)
    trainer = GuardedTrainer(model=model, args=_args(tmp_path, "out", 2), train_dataset=_ids(), ampguard=_quiet())
    with pytest.raises(ValueError) as refused:
        trainer.train()
    said = str(refused.value)
    assert "\n" not in said and said.startswith("parameter 'transformer.wte.weight' is bfloat16, but bf16 mixed "
                                                "precision keeps FP32 master weights")
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()  # the files it made are taken back
    from pathlib import Path
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    hf = " ".join(readme[readme.index("### Hugging Face Trainer"):readme.index("### Accelerate")].split())
    assert "dtype=torch.bfloat16" in hf and "dtype=torch.float32" in hf
    assert "is bfloat16, but bf16 mixed precision keeps FP32 master weights" in hf  # the refusal's own words


def test_an_fp16_scaler_turned_off_takes_no_floor_nor_says_a_setting_never_given(tmp_path):
    # review 53j: GuardedTrainer(scaler={"enabled": False}) under fp16 gave the guard a min_scale of
    # its own, which it then said was ignored; the callback was told of a scaler that does not run
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GuardedTrainer(model=_model(), args=_args(tmp_path, "off", 1, bf16=False, fp16=True),
                                 train_dataset=_ids(), ampguard=_quiet(), scaler={"enabled": False})
        trainer.train()
    said = [str(w.message) for w in caught if "ignored" in str(w.message)]
    assert said == [] and not trainer.guard.scaler.is_enabled(), said
    assert trainer.scaler_settings == {"enabled": False}


# ------------------------------------------------------------------ review 53i: the gradients put back later

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
