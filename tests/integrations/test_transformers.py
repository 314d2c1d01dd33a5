"""The Hugging Face Trainer under ampguard, for real: a tiny GPT-2 (from a GPT2Config, no download)
on in-memory token ids, on the CPU, with an injected overflow or NaN loss."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import EARLY_TIMEOUT_S, WARM_TORCHRUN, Ended, read_rows, run_to_end, torchrun_env, warm_workers

transformers = pytest.importorskip("transformers")
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ampguard.errors import InputError  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402
from ampguard.watch import float32_layers_text  # noqa: E402
from ampguard.sinks import CSV_COLUMNS  # noqa: E402


def tiny_gpt2(n_layer: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64, n_positions=16))


def token_ids(n: int = 160) -> list[dict[str, torch.Tensor]]:
    """A pattern to learn: each sequence counts up from a random start (mod 64); labels = inputs."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (n, 1), generator=g)
    return [{"input_ids": ids, "labels": ids} for ids in ((starts + torch.arange(16)) % 64)]


def arguments(tmp_path, precision: str, steps: int = 20, **extra) -> TrainingArguments:
    settings = dict(per_device_train_batch_size=4, max_steps=steps, use_cpu=True, report_to=[], logging_steps=1,
                    save_strategy="no", learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=0,
                    max_grad_norm=1.0, fp16=precision == "fp16", bf16=precision == "bf16", disable_tqdm=True)
    return TrainingArguments(str(tmp_path / "out"), **{**settings, **extra})


def inf_gradient_at(trainer: Trainer, model: GPT2LMHeadModel, steps: set[int]) -> None:
    """Write inf into one gradient during the backward of these optimizer steps (counted from 1)."""
    model.transformer.wte.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if trainer.state.global_step + 1 in steps else g)


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_guarded_trainer_fp16_skips_the_overflow_backs_off_and_holds_the_schedule(tmp_path):
    model = tiny_gpt2()
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp16"), train_dataset=token_ids(),
                             scaler={"init_scale": 1024.0, "growth_interval": 1000})
    inf_gradient_at(trainer, model, {5})
    trainer.train()

    folder = tmp_path / "out" / "ampguard"
    assert (folder / "steps.csv").read_text().splitlines()[0] == ",".join(CSV_COLUMNS)
    rows = read_rows(folder / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 21))  # one row per optimizer step
    assert [(r["step"], r["skip_reason"]) for r in rows if r["skipped"] == "1"] == [("5", "non_finite_grad")]
    skip = rows[4]
    assert skip["grad_l2_pre_clip"] == "inf" and skip["grad_l2_post_clip"] == ""
    assert [float(r["scaler_scale"]) for r in rows[3:6]] == [1024.0, 512.0, 512.0]  # one back-off
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[3] > lrs[4] == lrs[5] > lrs[6]  # HF's linear decay held on the skipped step
    applied = [r for r in rows if r["skipped"] == "0"]
    assert all(float(r["grad_l2_pre_clip"]) > 0 and float(r["grad_l2_post_clip"]) <= 1.0 + 1e-5 for r in applied)
    assert any(float(r["grad_l2_pre_clip"]) > 1.0 for r in applied)  # clipped, and the pre-clip norm shows it
    assert finite(model) and trainer.state.global_step == 20
    # the guard applied 19 updates and HF's own optimizer.step() (after the guard's) applied none
    adam_steps = {int(state["step"]) for state in trainer.guard.optimizer.state.values()}
    assert trainer.guard.updates == 19 and adam_steps == {19}
    # HF's own log now carries the guard's pre-clip norm (inf at the skip) and the held learning rate
    logged = {h["step"]: h for h in trainer.state.log_history if "grad_norm" in h}
    assert logged[5]["grad_norm"] == float("inf")
    assert logged[7]["grad_norm"] == pytest.approx(float(rows[6]["grad_l2_pre_clip"]))

    summary = json.loads((folder / "summary.json").read_text())
    assert (summary["steps"], summary["updates"], summary["skips"], summary["exit_code"]) == (
        20, 19, {"non_finite_grad": 1}, 0)
    assert summary["final_scale"] == 512.0 and summary["guarded"] is True
    card = (folder / "RUN.md").read_text()  # the run card shows the overflow too
    assert "| steps / updates applied | 20 / 19 |" in card
    assert "| skipped steps | 1 (non_finite_grad 1) |" in card and "| loss scale | 512 at the end" in card
    # the layers autocast left in float32 in the first forward, as ampguard train's card names them
    dtypes = trainer.autocast_dtypes
    assert dtypes["transformer.wte"] == "float32" and dtypes["transformer.h.0.attn.c_attn"] == "float16"
    assert f"| float32 under autocast | {float32_layers_text(dtypes)} |" in card
    assert summary["float32_under_autocast"].startswith("transformer.wte, transformer.wpe, ")


def test_guarded_trainer_bf16_nan_loss_never_reaches_the_weights(tmp_path):
    class NanAtStep3(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            return loss * float("nan") if self.state.global_step + 1 == 3 else loss

    model = tiny_gpt2()
    trainer = NanAtStep3(model=model, args=arguments(tmp_path, "bf16", steps=4, gradient_accumulation_steps=2),
                         train_dataset=token_ids())
    trainer.train()
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert [(r["step"], r["skip_reason"], r["loss"], r["grad_l2_pre_clip"]) for r in rows if r["skipped"] == "1"] == [
        ("3", "non_finite_loss", "nan", "")]
    assert {r["scaler_scale"] for r in rows} == {"1.0"}  # bf16: no loss scaler
    assert float(rows[2]["lr"]) == float(rows[3]["lr"])
    assert finite(model)
    # HF's logging_nan_inf_filter hides the NaN from its own log; the CSV keeps it
    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    assert torch.isfinite(torch.tensor(logged[3]))


def test_guarded_trainer_fail_fast_stops_the_trainer_and_says_why(tmp_path):
    model = tiny_gpt2()
    guard_cb = AmpGuardCallback(fail_rate=0.5, fail_after=2, print_fn=lambda line: None)
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "bf16"), train_dataset=token_ids(),
                             callbacks=[guard_cb])
    inf_gradient_at(trainer, model, set(range(3, 21)))
    trainer.train()
    # skip rate 1/3, 2/4, 3/5 (> 0.5), 4/6 (> 0.5 twice in a row): stopped at step 6 of 20
    assert trainer.state.global_step == 6 and guard_cb.exit_code == 3
    assert trainer.ampguard is guard_cb and len(read_rows(tmp_path / "out" / "ampguard" / "steps.csv")) == 6
    summary = json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text())
    assert summary["exit_code"] == 3 and summary["cause"] == "skip_rate"
    assert summary["ended"].startswith("stopped by a guard at step 6: rolling skip rate above fail_rate 0.5")
    events = [json.loads(line) for line in (tmp_path / "out" / "ampguard" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events][-2:] == [("fail", 6), ("run_end", 6)]
    assert finite(model)


def test_stock_trainer_with_the_callback_alone_sees_the_poisoned_update_it_cannot_stop(tmp_path):
    # fp16=True on a CPU: Accelerate makes no scaler and no autocast; bf16 here has no scaler either.
    # Nothing skips the inf gradient: HF applies it, the callback says so and stops the run there
    # (a guard failure, exit code 3: every later step would be NaN).
    lines: list[str] = []
    model = tiny_gpt2()
    callback = AmpGuardCallback(print_fn=lines.append)
    trainer = Trainer(model=model, args=arguments(tmp_path, "bf16", steps=4), train_dataset=token_ids(),
                      callbacks=[callback])
    inf_gradient_at(trainer, model, {3})
    trainer.train()
    # the layers the Trainer's autocast left in float32, noted around its first micro-batch (hooks gone after)
    dtypes = callback.autocast_dtypes
    assert dtypes["transformer.wte"] == "float32" and dtypes["transformer.h.0.attn.c_attn"] == "bfloat16"
    assert not any(m._forward_hooks for m in model.modules())
    card = (tmp_path / "out" / "ampguard" / "RUN.md").read_text()
    assert f"| float32 under autocast | {float32_layers_text(dtypes)} |" in card
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert [r["skipped"] for r in rows] == ["0"] * 3  # stopped at step 3 of 4
    assert rows[0]["loss"] == rows[0]["grad_l2_pre_clip"] == ""  # not shown to a callback
    assert 0 < float(rows[0]["grad_l2_post_clip"]) <= 1.0 + 1e-5 and float(rows[0]["lr"]) == 3e-3
    assert rows[2]["grad_l2_post_clip"] in ("nan", "inf")
    assert any(line.startswith("FAIL 3 the Trainer applied a non-finite gradient") for line in lines)
    assert trainer.state.global_step == 3 and callback.exit_code == 3
    assert not finite(model)  # what the guard exists to prevent


def test_an_existing_csv_is_refused_before_any_step(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "steps.csv").write_text("keep me\n")
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "bf16"), train_dataset=token_ids(),
                             ampguard=AmpGuardCallback(folder))
    with pytest.raises(InputError, match="already exists; refusing to overwrite it"):
        trainer.train()
    assert (folder / "steps.csv").read_text() == "keep me\n"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_stock_trainer_refused_for_an_existing_event_log_leaves_no_csv_behind(tmp_path):
    # review_51e: steps.csv was made before events.jsonl was refused; a stock Trainer never tells
    # the callback train() raised, so the header stayed and the next run was refused for it
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "events.jsonl").write_text("keep me\n")
    for _ in range(2):  # (the second time refused for the same file, not for a CSV of the first's)
        trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(8),
                          callbacks=[AmpGuardCallback(folder, print_fn=lambda line: None)])
        with pytest.raises(InputError, match=r"events\.jsonl already exists; refusing to overwrite it"):
            trainer.train()
        assert sorted(p.name for p in folder.iterdir()) == ["events.jsonl"]
    assert (folder / "events.jsonl").read_text() == "keep me\n"


def _stock_step(handler, args, state, control, optimizer, model, *, poisoned: bool) -> float | None:
    """One optimizer step as a stock Trainer takes it with Accelerate's GradScaler (fp16 on a GPU),
    driven by hand on the CPU through HF's own CallbackHandler: ``accelerator.backward`` (the scaled
    loss), ``clip_grad_norm_`` (its unscale), ``on_pre_optimizer_step``, ``AcceleratedOptimizer.step``
    (the scaler's step and update), ``zero_grad``, then ``on_step_end`` with the new global step.
    Returns the post-clip norm the optimizer saw (None when not finite)."""
    loss = model(torch.ones(3, 4)).sum() * (float("inf") if poisoned else 1.0)
    optimizer.scaler.scale(loss).backward()
    optimizer.scaler.unscale_(optimizer.optimizer)  # what accelerator.clip_grad_norm_ does first
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    handler.on_pre_optimizer_step(args, state, control)
    optimizer.step()
    optimizer.zero_grad()
    state.global_step += 1
    handler.on_step_end(args, state, control)
    return norm if math.isfinite(norm) else None


def _stock_trainer_parts(tmp_path, callback, model, *, init_scale: float, growth_interval: int = 2000):
    """Real HF and Accelerate objects around ``callback``: TrainingArguments, TrainerState,
    TrainerControl, an AcceleratedOptimizer holding a GradScaler, and HF's CallbackHandler."""
    import accelerate
    from accelerate.optimizer import AcceleratedOptimizer
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import CallbackHandler

    args = TrainingArguments(str(tmp_path / "out"), use_cpu=True, max_grad_norm=1.0, report_to=[])
    assert args.device.type == "cpu"  # (setting up its device resets Accelerate's state: the Accelerator comes after)
    accelerate.Accelerator(cpu=True)  # Accelerate's process state, as the Trainer makes it (reset after the test)
    state, control = TrainerState(), TrainerControl()
    state.is_world_process_zero, state.global_step = True, 0
    optimizer = AcceleratedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), device_placement=False,
                                     scaler=torch.amp.GradScaler("cpu", init_scale=init_scale,
                                                                 growth_interval=growth_interval))
    handler = CallbackHandler([callback], model, None, optimizer, None)
    return args, state, control, optimizer, handler


@pytest.mark.parametrize("poisoned", [False, True])
def test_the_callback_reads_a_stock_steps_norm_skip_and_scale_in_one_host_read(tmp_path, poisoned):
    # the post-clip norm, the found-inf flag and the updated scale come over together, in on_step_end
    from helpers import HostReads

    from ampguard.integrations.transformers import WatchOnlyWarning

    model = torch.nn.Linear(4, 2)
    callback = AmpGuardCallback(print_fn=lambda line: None)
    args, state, control, optimizer, handler = _stock_trainer_parts(tmp_path, callback, model, init_scale=8.0,
                                                                    growth_interval=1)
    with pytest.warns(WatchOnlyWarning):
        handler.on_train_begin(args, state, control)
    before = [p.detach().clone() for p in model.parameters()]
    on_step_end = handler.on_step_end

    def counted(*a, **k):
        with HostReads() as reads:
            result = on_step_end(*a, **k)
        counts.append(reads.count)
        return result

    counts: list[int] = []
    handler.on_step_end = counted
    norm = _stock_step(handler, args, state, control, optimizer, model, poisoned=poisoned)
    assert counts == [1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) == poisoned  # the scaler skipped it
    handler.on_train_end(args, state, control)
    [row] = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")  # <output_dir>/ampguard, from the real args
    assert (row["step"], row["skipped"], row["lr"], row["loss"], row["grad_l2_pre_clip"]) == (
        "1", "1" if poisoned else "0", "0.1", "", "")
    assert row["scaler_scale"] == ("4.0" if poisoned else "16.0")  # after the real scaler's update
    if poisoned:
        assert (row["skip_reason"], row["grad_l2_post_clip"], norm) == ("non_finite_grad", "", None)
    else:
        assert row["skip_reason"] == "" and row["grad_l2_post_clip"] == repr(norm) and norm > 0
    assert callback.monitor.steps == 1 and callback.monitor.updates == (0 if poisoned else 1)


@pytest.mark.parametrize("fail_after", [None, 2])
def test_the_callback_on_a_stock_gradscaler_writes_its_summary_and_judges_the_scale(tmp_path, fail_after):
    # a stock Trainer's GradScaler has no floor: the monitor was given 0.0 and the scale's label
    # divided by it (ZeroDivisionError in on_train_end: no summary.json, no RUN.md); it takes 1.0.
    # With fail-fast on, the failure reaches the real TrainerControl.
    from ampguard.integrations.transformers import WatchOnlyWarning

    model = torch.nn.Linear(4, 2)
    fail = {"fail_rate": 0.5, "fail_after": fail_after, "min_steps": 0} if fail_after else {}
    callback = AmpGuardCallback(out_dir=tmp_path / "ag", print_fn=lambda line: None, **fail)
    args, state, control, optimizer, handler = _stock_trainer_parts(tmp_path, callback, model, init_scale=4.0)
    with pytest.warns(WatchOnlyWarning):
        handler.on_train_begin(args, state, control)
    stopped_at = []
    for _ in (1, 2, 3):  # every step overflows: 4 -> 2 -> 1 (the floor) -> 0.5
        _stock_step(handler, args, state, control, optimizer, model, poisoned=True)
        if control.should_training_stop and not stopped_at:
            stopped_at.append(state.global_step)
    handler.on_train_end(args, state, control)
    rows = read_rows(tmp_path / "ag" / "steps.csv")
    assert [(r["step"], r["skipped"], r["skip_reason"], r["scaler_scale"]) for r in rows] == [
        ("1", "1", "non_finite_grad", "2.0"), ("2", "1", "non_finite_grad", "1.0"),
        ("3", "1", "non_finite_grad", "0.5")]
    summary = json.loads((tmp_path / "ag" / "summary.json").read_text())
    assert summary["scale"] == "collapsing" and summary["max_skip_rate"] == 1.0
    assert (tmp_path / "ag" / "RUN.md").exists()
    assert summary["steps"] == 3 and summary["updates"] == 0 and summary["guarded"] is False
    assert callback.monitor.min_scale == 1.0 and callback.monitor.opening == 0  # reached the floor: no search
    if fail_after is None:
        assert stopped_at == [] and summary["exit_code"] == 0 and summary["ended"] == "finished: 3 steps"
    else:  # the opening counts once a step at the floor (1.0, step 3) overflowed too: the stop is asked
        # at step 3 (a real Trainer then ends its loop); review 51i: the back-off to the floor is not it
        assert stopped_at == [3] and summary["exit_code"] == 3, summary
        assert summary["ended"].startswith("stopped by a guard at step 3: "), summary


# ---------------------------------------------------------------- HF's groups, resume, evaluation


@pytest.mark.parametrize("loss", ["num_items_in_batch", "per_micro_batch"])
def test_an_epochs_short_last_group_is_the_stock_trainers_step_bit_for_bit(tmp_path, loss):
    # 28 sequences in batches of 4: 7 batches an epoch, so with GA 3 HF steps after batches 3, 6
    # and 7 (a group of one). GPT-2 normalises its loss over the group's tokens (HF's
    # num_items_in_batch); without it HF divides each loss by the group's batch count.
    def run(cls, folder, **extra):
        model = tiny_gpt2()
        trainer = cls(model=model, args=arguments(folder, "bf16", steps=-1, num_train_epochs=2,
                                                  gradient_accumulation_steps=3), train_dataset=token_ids(28), **extra)
        if loss == "per_micro_batch":
            trainer.model_accepts_loss_kwargs = False
        trainer.train()
        AcceleratorState._reset_state(reset_partial_state=True)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        return model, logged, trainer.state.global_step

    stock, stock_losses, stock_steps = run(Trainer, tmp_path / "stock")
    guarded, losses, steps = run(GuardedTrainer, tmp_path, ampguard=AmpGuardCallback(print_fn=lambda line: None))
    assert steps == stock_steps == 6  # 3 a pass, the third of each a group of one micro-batch
    assert all(torch.equal(a, b) for a, b in zip(stock.parameters(), guarded.parameters()))
    assert losses == stock_losses
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, 7)) and {r["skipped"] for r in rows} == {"0"}
    # each row's loss is the group's own (the short group's too), the loss HF logs for the step
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses, rel=1e-6)
    summary = json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text())
    assert (summary["ended"], summary["exit_code"]) == ("finished: 6 steps", 0)


def test_a_loss_computed_outside_the_forward_is_the_stock_trainers_in_training_and_evaluation(tmp_path):
    # label_smoothing_factor: HF computes the loss from the logits after the forward. Accelerate
    # autocasts only the stock Trainer's forward and hands its outputs back in float32, so the
    # smoothed loss is computed in float32; under an autocast around the whole of compute_loss it
    # was computed from bf16 log-probabilities (the loss and the weights then differed)
    def run(cls, folder, **extra):
        model = tiny_gpt2()
        trainer = cls(model=model, args=arguments(folder, "bf16", steps=3, label_smoothing_factor=0.1),
                      train_dataset=token_ids(16), eval_dataset=token_ids(8), **extra)
        before = trainer.evaluate()["eval_loss"]
        trainer.train()
        AcceleratorState._reset_state(reset_partial_state=True)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        return model, logged, before

    stock, stock_losses, stock_eval = run(Trainer, tmp_path / "stock")
    guarded, losses, evaluated = run(GuardedTrainer, tmp_path, ampguard=AmpGuardCallback(print_fn=lambda line: None))
    assert evaluated == stock_eval and losses == stock_losses and len(losses) == 3
    assert all(torch.equal(a, b) for a, b in zip(stock.parameters(), guarded.parameters()))


def test_in_fp32_a_bf16_models_outputs_are_left_in_bf16_as_the_stock_trainer_leaves_them(tmp_path):
    # no mixed precision: Accelerate does not wrap the stock Trainer's forward, so a model kept in
    # bf16 (loaded so) gives its logits in bf16, and the label smoother computes from them; the
    # guard converts nothing either
    def run(cls, folder, **extra):
        model = tiny_gpt2().to(torch.bfloat16)
        trainer = cls(model=model, args=arguments(folder, "fp32", steps=2, label_smoothing_factor=0.1),
                      train_dataset=token_ids(8), eval_dataset=token_ids(4), **extra)
        trainer.train()  # (the smoothed loss is computed from the logits after the forward: bf16 ones)
        predictions = trainer.predict(token_ids(4)).predictions
        AcceleratorState._reset_state(reset_partial_state=True)
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
        return model, logged, str(predictions.dtype)

    stock, stock_losses, stock_dtype = run(Trainer, tmp_path / "stock")
    guarded, losses, dtype = run(GuardedTrainer, tmp_path, ampguard=AmpGuardCallback(print_fn=lambda line: None))
    assert losses == stock_losses and dtype == stock_dtype
    assert all(torch.equal(a, b) for a, b in zip(stock.parameters(), guarded.parameters()))


def test_hfs_optimizer_step_after_the_guards_does_nothing_a_step_hook_counts_each_update_once(tmp_path):
    # HF's loop calls optimizer.step() after the guard's: it found no gradients, but a step post-hook
    # (an EMA's) or an optimizer with state of its own per step (schedule-free's k) counted twice
    class NanLossAt3(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            loss = super().compute_loss(model, inputs, **kwargs)
            return loss * float("nan") if self.state.global_step + 1 == 3 else loss

    def run(cls, folder, **extra):
        calls = []
        trainer = cls(model=tiny_gpt2(), args=arguments(folder, "bf16", steps=4), train_dataset=token_ids(16),
                      **extra)
        trainer.create_optimizer()
        trainer.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: calls.append(trainer.state.global_step))
        trainer.train()
        trained = list(calls)
        trainer.optimizer.step()  # one's own call after train(), not after a guard's step, goes through
        AcceleratorState._reset_state(reset_partial_state=True)
        return trained, calls[len(trained):], trainer

    assert run(Trainer, tmp_path / "stock")[:2] == ([0, 1, 2, 3], [4])
    trained, after, trainer = run(NanLossAt3, tmp_path, ampguard=AmpGuardCallback(print_fn=lambda line: None))
    assert trained == [0, 1, 3] and trainer.guard.updates == 3 and after == [4]  # step 3 skipped: no step, no hook


class Batches(torch.utils.data.IterableDataset):
    """A dataset without a length: 10 sequences, then it runs out (HF then iterates it again)."""

    def __iter__(self):
        return iter(token_ids(10))


def test_an_error_that_ends_train_is_written_to_the_run_end_summary_and_card(tmp_path):
    # a dataset without a length: HF fetches groups of GA batches until it runs out. 10 sequences
    # are 3 batches, so with GA 2 the second group has one batch, after which HF does not step:
    # it carries the group on into the next pass. The guard refuses such a group, and the error
    # that ends train() is still written down.
    model = tiny_gpt2()
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "bf16", steps=4, gradient_accumulation_steps=2),
                             train_dataset=Batches(), ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(RuntimeError, match="HF does not step after micro-batch 1 of the 1 it fetched for this group"):
        trainer.train()
    folder = tmp_path / "out" / "ampguard"
    assert [r["step"] for r in read_rows(folder / "steps.csv")] == ["1"]
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["exit_code"] == 1 and summary["steps"] == 1
    assert summary["ended"].startswith("crashed after step 1: RuntimeError: HF does not step after micro-batch 1 ")
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    assert (events[-1]["event"], events[-1]["exit_code"]) == ("run_end", 1)
    assert "| ended | crashed after step 1" in (folder / "RUN.md").read_text()
    assert trainer.ampguard.exit_code == 1


def test_a_ctrl_c_in_train_is_written_down_as_interrupted(tmp_path):
    class CtrlCAtStep3(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            if self.state.global_step + 1 == 3:
                raise KeyboardInterrupt
            return super().compute_loss(model, inputs, **kwargs)

    trainer = CtrlCAtStep3(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=5), train_dataset=token_ids(),
                           ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    summary = json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text())
    assert (summary["ended"], summary["exit_code"], summary["steps"]) == ("interrupted after step 2", 130, 2)
    assert trainer.ampguard.exit_code == 130


def test_a_ctrl_c_in_a_fresh_runs_first_step_still_gives_130(tmp_path):
    # review_51e: the files of a run with no step are taken back, and exit_code stayed 0: the
    # README's `raise SystemExit(trainer.ampguard.exit_code)` reported a preempted job as a success
    class CtrlCAtStep1(GuardedTrainer):
        def compute_loss(self, model, inputs, **kwargs):
            raise KeyboardInterrupt

    trainer = CtrlCAtStep1(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=5), train_dataset=token_ids(),
                           ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert trainer.ampguard.exit_code == 130
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()  # taken back: a new run starts afresh


def test_a_second_train_that_fails_before_it_begins_has_its_own_exit_code(tmp_path):
    # review_51l: the second train()'s failure before on_train_begin (a checkpoint that is not there)
    # left exit_code at the first train()'s 0
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(16),
                             ampguard=AmpGuardCallback(print_fn=lambda line: None))
    trainer.train()
    assert trainer.ampguard.exit_code == 0
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "no-such-checkpoint"))
    assert trainer.ampguard.exit_code == 1


def test_a_resume_goes_on_at_the_checkpoints_step_with_its_scale_and_monitor(tmp_path):
    # fp16: the overflow at step 2 halves the scale (1024 -> 512); HF saves a checkpoint at step 2
    args = arguments(tmp_path, "fp16", steps=4, save_strategy="steps", save_steps=2)
    model = tiny_gpt2()
    first = GuardedTrainer(model=model, args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0})
    inf_gradient_at(first, model, {2})
    first.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    folder = tmp_path / "out" / "ampguard"
    whole = (folder / "steps.csv").read_text()
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "ampguard_state.json").read_text())
    # the layers autocast left in float32, a record kept with the checkpoint (seed 001)
    assert state["autocast_dtypes"] == first.autocast_dtypes and state["autocast_dtypes"]["transformer.wte"] == "float32"

    # resume the same folder from step 2: rows 3-4 (the abandoned future) are cut and trained again
    again = tiny_gpt2()
    resumed = GuardedTrainer(model=again, args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0})
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert resumed.state.global_step == 4 and resumed.guard.steps == 4 and resumed.guard.updates == 3
    # the steps go on at 3, at the saved scale (512, not init_scale): the uninterrupted run's rows, bit for bit
    assert (folder / "steps.csv").read_text() == whole
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    summary = json.loads((folder / "summary.json").read_text())  # the monitor went on from step 2's counts
    assert (summary["steps"], summary["updates"], summary["skips"], summary["final_scale"]) == (
        4, 3, {"non_finite_grad": 1}, 512.0)
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    # 1 of the run's 4 steps skipped: above alert_rate, said at its end (too short to arm the rolling ALERT)
    assert [(e["event"], e["step"]) for e in events][-3:] == [("resume", 2), ("skip_rate_alert", 4), ("run_end", 4)]

    # the state of an fp16 run does not fit a bf16 one: refused before anything is written
    bf16 = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=4), train_dataset=token_ids())
    with pytest.raises(InputError, match="saved with precision='fp16', this step uses 'bf16'"):
        bf16.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert (folder / "steps.csv").read_text() == whole


def test_the_first_log_after_a_resume_counts_the_skips_since_the_runs_last_log(tmp_path):
    # logs at steps 2 and 4, the checkpoint at 3, an overflow at 3: the resumed run's log at step 4
    # said 0 skipped (it counted from the checkpoint), and step 3's skip reached no log at all
    args = arguments(tmp_path, "fp16", steps=4, logging_steps=2, save_strategy="steps", save_steps=3)
    model = tiny_gpt2()
    first = GuardedTrainer(model=model, args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0})
    inf_gradient_at(first, model, {3})
    first.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    resumed = GuardedTrainer(model=tiny_gpt2(), args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0})
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    AcceleratorState._reset_state(reset_partial_state=True)
    logs = {h["step"]: h["ampguard/skipped"] for h in resumed.state.log_history if "loss" in h}
    assert logs == {2: 0, 4: 1}  # (step 2's from the first run's trainer_state, step 4's the resumed run's)
    state = tmp_path / "out" / "checkpoint-3" / "ampguard_state.json"
    saved = json.loads(state.read_text())
    assert saved["logged"] == {"skips": 0, "steps": 2}
    state.write_text(json.dumps({**saved, "logged": {"skips": 5, "steps": 2}}))  # (a hand edit: more than its monitor's)
    csv = (tmp_path / "out" / "ampguard" / "steps.csv").read_text()
    with pytest.raises(InputError, match=r"checkpoint-3/ampguard_state\.json: its logged counts .* do not fit"):
        GuardedTrainer(model=tiny_gpt2(), args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0}).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert (tmp_path / "out" / "ampguard" / "steps.csv").read_text() == csv  # refused before any file changed
    # a state saved before the counts were kept: every step up to the checkpoint taken as logged
    state.write_text(json.dumps({k: v for k, v in saved.items() if k != "logged"}))
    older = GuardedTrainer(model=tiny_gpt2(), args=args, train_dataset=token_ids(), scaler={"init_scale": 1024.0})
    older.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert {h["step"]: h["ampguard/skipped"] for h in older.state.log_history if "loss" in h} == {2: 0, 4: 0}


def test_evaluate_and_predict_autocast_as_the_stock_trainer_does(tmp_path):
    # Accelerate autocasts the stock Trainer's forward (bf16 on a CPU too) and hands its outputs
    # back in float32; GuardedTrainer told Accelerate "no", so it brings both back itself
    def run(cls, **extra):
        model = tiny_gpt2()
        seen = set()
        model.transformer.h[0].attn.c_attn.register_forward_hook(
            lambda module, args, out: seen.add(out.dtype) if not module.training else None)
        trainer = cls(model=model, args=arguments(tmp_path, "bf16", steps=1), train_dataset=token_ids(8),
                      eval_dataset=token_ids(8), **extra)
        metrics = trainer.evaluate()
        predictions = trainer.predict(token_ids(4)).predictions
        AcceleratorState._reset_state(reset_partial_state=True)
        return seen, metrics["eval_loss"], predictions.dtype

    guarded = run(GuardedTrainer, ampguard=AmpGuardCallback(tmp_path / "ag"))
    assert guarded == run(Trainer)
    assert guarded[0] == {torch.bfloat16} and str(guarded[2]) == "float32"


# ---------------------------------------------------------------- watched, not guarded: said up front


def test_a_stock_trainer_with_the_callback_warns_once_that_it_only_watches(tmp_path):
    # the stock Trainer's rows have no loss and no pre-clip norm, and nothing checks the loss
    # before backward: the user hears it when training begins, not only in RUN.md afterwards
    from ampguard.integrations.transformers import WatchOnlyWarning

    trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(8),
                      callbacks=[AmpGuardCallback(print_fn=lambda line: None)])
    with pytest.warns(WatchOnlyWarning) as seen:
        trainer.train()
    watch_only = [w for w in seen if issubclass(w.category, WatchOnlyWarning)]
    assert len(watch_only) == 1 and issubclass(WatchOnlyWarning, UserWarning)
    assert str(watch_only[0].message) == (
        "AmpGuardCallback on a stock Trainer only watches (no loss check before backward, no pre-clip norm: the "
        "CSV's loss and grad_l2_pre_clip stay empty): use ampguard.integrations.transformers.GuardedTrainer(..., "
        "ampguard=...) to guard the step")
    assert len(read_rows(tmp_path / "out" / "ampguard" / "steps.csv")) == 2  # and it still watched


def test_a_stock_trainer_with_the_callback_resumes_in_its_own_output_dir(tmp_path):
    # review 33c: the resume was refused "steps.csv already exists" (only GuardedTrainer told the
    # callback of a resume); HF has loaded the checkpoint's global_step by on_train_begin
    def stock():
        return Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=4, save_strategy="steps",
                                                         save_steps=2), train_dataset=token_ids(16),
                       callbacks=[AmpGuardCallback(print_fn=lambda line: None)])

    with pytest.warns(UserWarning):
        stock().train()
    csv = tmp_path / "out" / "ampguard" / "steps.csv"
    rows = read_rows(csv)
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.warns(UserWarning):
        stock().train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    again = read_rows(csv)
    assert [r["step"] for r in again] == ["1", "2", "3", "4"] and again[:2] == rows[:2]
    events = [json.loads(line) for line in (tmp_path / "out" / "ampguard" / "events.jsonl").read_text().splitlines()]
    resumed = next(e for e in events if e["event"] == "resume")
    assert resumed["step"] == 2 and "a stock Trainer's checkpoint holds no ampguard state" in resumed["message"]
    # a steps.csv whose rows end before the checkpoint's step (an older or copied one): the rows
    # appended after the gap are said (review 33c: a CSV of steps 1, 5, 6, unsaid)
    lines = csv.read_text(encoding="utf-8").splitlines(keepends=True)
    csv.write_text("".join(lines[:2]), encoding="utf-8")
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.warns(UserWarning) as said:
        stock().train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert any("steps.csv's rows end at step 1, before the checkpoint's 2: steps 2 to 2 have no row" in str(w.message)
               for w in said)


class StockCrashAtFirst(Trainer):
    crash = True

    def compute_loss(self, model, inputs, **kwargs):
        if self.crash:
            raise RuntimeError("boom")
        return super().compute_loss(model, inputs, **kwargs)


def test_a_stock_trainer_whose_train_raised_before_its_first_row_trains_again_in_the_same_folder(tmp_path):
    # a stock Trainer does not tell a callback that train() raised: the next train() takes the files
    # the one before made back when it recorded no step (it was refused "steps.csv already exists")
    trainer = StockCrashAtFirst(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2),
                                train_dataset=token_ids(8), callbacks=[AmpGuardCallback(print_fn=lambda line: None)])
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="boom"):
        trainer.train()
    trainer.crash = False
    with pytest.warns(UserWarning):
        trainer.train()
    assert [r["step"] for r in read_rows(tmp_path / "out" / "ampguard" / "steps.csv")] == ["1", "2"]


def test_the_callback_refuses_what_it_cannot_use_when_it_is_made(tmp_path):
    # review 33c: print_fn=None trained every step and crashed at the end; sinks="mlflow" (read as
    # report_to) or [None] failed after step 1 had updated the weights; window=2.5 failed deep in
    # the monitor; a callback a GuardedTrainer took, given to a stock Trainer, failed at its first
    # step with GuardedTrainer's "training_step is overridden" error
    with pytest.raises(TypeError, match=r"print_fn=\.\.\.\) must be a function of one line, like print; got NoneType"):
        AmpGuardCallback(print_fn=None)
    with pytest.raises(TypeError, match=r"got 'mlflow' \(HF's report_to names trackers: give the sink itself"):
        AmpGuardCallback(sinks="mlflow")
    with pytest.raises(TypeError, match=r"None is no ampguard sink"):
        AmpGuardCallback(sinks=[None])
    with pytest.raises(ValueError, match=r"window must be a whole number of steps, got 2\.5"):
        AmpGuardCallback(window=2.5)
    callback = AmpGuardCallback(print_fn=lambda line: None)
    GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=1), train_dataset=token_ids(4),
                   ampguard=callback)
    with pytest.raises(ValueError, match=r"this callback belongs to a GuardedTrainer already .* give a stock Trainer "
                                         r"its own AmpGuardCallback\(\)"):
        Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=1), train_dataset=token_ids(4),
                callbacks=[callback])


def test_a_guarded_trainer_does_not_warn_that_it_only_watches(tmp_path):
    import warnings

    from ampguard.integrations.transformers import WatchOnlyWarning

    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(8),
                             ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in seen if issubclass(w.category, WatchOnlyWarning)]
    assert json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text())["guarded"] is True


class _Logged:
    """A callback that keeps each training log it is given, as a ``report_to`` tracker's on_log
    sees it (HF calls the callbacks in their order, all with the one dict)."""

    def __init__(self):
        self.logs = []

    def __getattr__(self, name):  # the TrainerCallback events it does not keep
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append((state.global_step, {k: v for k, v in logs.items() if k.startswith("ampguard/")}))


def test_a_guarded_trainers_logs_tell_every_tracker_what_the_guard_did(tmp_path):
    # nothing in HF's report_to trackers said a step was skipped: only the callback's files and sinks
    logged = _Logged()  # before the callback in HF's list, as report_to's trackers are
    model = tiny_gpt2()
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp16", steps=8, logging_steps=3),
                             train_dataset=token_ids(), callbacks=[logged],
                             scaler={"init_scale": 1024.0, "growth_interval": 1000})
    assert trainer.callback_handler.callbacks.index(logged) < trainer.callback_handler.callbacks.index(trainer.ampguard)
    inf_gradient_at(trainer, model, {5, 8})
    trainer.train()
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    expected = [(3, {"ampguard/skipped": 0, "ampguard/skip_rate": 0.0, "ampguard/scale": 1024.0}),
                (6, {"ampguard/skipped": 1, "ampguard/skip_rate": 1 / 6, "ampguard/scale": 512.0})]
    assert logged.logs == expected
    assert [float(rows[step - 1]["scaler_scale"]) for step, _ in expected] == [1024.0, 512.0]
    history = [{k: v for k, v in h.items() if k.startswith("ampguard/")} for h in trainer.state.log_history]
    assert history[:2] == [values for _, values in expected]  # and HF's own log history
    # the final log (train_runtime's) carries steps 7-8, after the last training log: step 8's skip
    assert "train_runtime" in trainer.state.log_history[-1]
    assert history[-1] == {"ampguard/skipped": 1, "ampguard/skip_rate": 2 / 8, "ampguard/scale": 256.0}


def test_the_final_log_gets_no_keys_when_no_step_came_after_the_last_training_log(tmp_path):
    # steps 2 and 4 logged: the final log (train_runtime's) had the keys again, and a tracker such
    # as MLflow held two values for ampguard/scale, skip_rate and skipped at step 4
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=4, logging_steps=2),
                             train_dataset=token_ids(16))
    trainer.train()
    keys = [[k for k in h if k.startswith("ampguard/")] for h in trainer.state.log_history]
    assert "train_runtime" in trainer.state.log_history[-1] and keys[-1] == []
    assert [len(k) for k in keys[:-1]] == [3, 3]  # (the training logs at steps 2 and 4 have them)


def test_a_stock_trainer_whose_callback_comes_first_gives_the_trackers_its_keys(tmp_path):
    # a stock Trainer calls report_to's callbacks first: moved before them, the callback's on_log
    # adds its keys in time (README's one line); where it is, they come after the trackers logged
    logged, callback = _Logged(), AmpGuardCallback(print_fn=lambda line: None)
    args = arguments(tmp_path, "bf16", steps=4, logging_steps=2)
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=token_ids(16), callbacks=[logged, callback])
    trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(AmpGuardCallback))
    with pytest.warns(UserWarning, match="only watches"):
        trainer.train()
    assert logged.logs == [(2, {"ampguard/skipped": 0, "ampguard/skip_rate": 0.0, "ampguard/scale": 1.0}),
                           (4, {"ampguard/skipped": 0, "ampguard/skip_rate": 0.0, "ampguard/scale": 1.0})]
    late = _Logged()  # left where HF puts it (after the trackers): they logged without the keys
    trainer = Trainer(model=tiny_gpt2(), args=arguments(tmp_path / "b", "bf16", steps=2, logging_steps=2),
                      train_dataset=token_ids(16), callbacks=[late, AmpGuardCallback(print_fn=lambda line: None)])
    with pytest.warns(UserWarning, match="only watches"):
        trainer.train()
    assert late.logs == [(2, {})]


DDP_TRAIN = '''
import os
import signal
import sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
g = torch.Generator().manual_seed(0)
starts = torch.randint(0, 64, (32, 1), generator=g)
data = [{"input_ids": ids, "labels": ids} for ids in ((starts + torch.arange(16)) % 64)]
args = TrainingArguments(sys.argv[1], per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=5,
                         use_cpu=True, report_to=[], save_strategy="no", learning_rate=3e-3,
                         lr_scheduler_type="linear", max_grad_norm=1.0, bf16=True, disable_tqdm=True,
                         ddp_backend="gloo")
callback = AmpGuardCallback(print_fn=lambda line: None)
trainer = GuardedTrainer(model=model, args=args, train_dataset=data, ampguard=callback)
records, take = [], callback.take
callback.take = lambda record: (records.append((record.step, record.skipped, record.reason)), take(record))[1]


def nan_on_rank_1_at_step_3(module, inputs, output):  # the second micro-batch of step 3, rank 1 alone
    if args.process_index == 1 and trainer.state.global_step + 1 == 3 and len(records) == 2:
        nan_on_rank_1_at_step_3.micro = getattr(nan_on_rank_1_at_step_3, "micro", 0) + 1
        if nan_on_rank_1_at_step_3.micro == 2:
            output["loss"] = output["loss"] * float("nan")
    return output


class TermRank1AtStep4(TrainerCallback):  # a SIGTERM to rank 1's process alone, at step 4's end
    def on_step_end(self, args_, state, control, **kwargs):
        if args.process_index == 1 and state.global_step == 4:
            os.kill(os.getpid(), signal.SIGTERM)


model.register_forward_hook(nan_on_rank_1_at_step_3)
trainer.add_callback(TermRank1AtStep4())
trainer.callback_handler.callbacks.sort(key=lambda c: isinstance(c, AmpGuardCallback))  # (the guard's last)
try:
    trainer.train()
except KeyboardInterrupt as stopped:  # (ampguard's Interrupted, raised as train() returns)
    sys.stdout.write(f"rank {args.process_index} stopped: {int(stopped.exit_code)} {callback.ended}\\n")
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
# one write a line: both ranks share this stdout, and print's line and its newline are two writes
# (rank 1's line landed between rank 0's and its newline: one line, one rank found)
sys.stdout.write(f"rank {args.process_index}: {records} lr {trainer.optimizer.param_groups[0]['lr']!r} "
                 f"checksum {checksum!r}\\n")
sys.stdout.flush()
# The trainer freed, then the process group destroyed: its gloo threads end before the interpreter's
# teardown. While the trainer holds the DDP model, destroy_process_group leaves them running, and one
# still dropping HF's last all_gather's tensors needs the GIL: asked for during the teardown, that
# thread is ended mid-destructor and the rank aborts ("terminate called without an active exception",
# exit -6; 1 run in 12 on a loaded machine, traced with gdb). What ampguard.distributed.shutdown does.
import gc
del trainer, model, callback
gc.collect()
torch.distributed.destroy_process_group()
'''


def early(work: Path) -> dict[str, Ended]:
    """The torchrun of the test below (torchrun forked warm too, and its two workers, each
    importing transformers: ``helpers.warm_workers``), run to its end: an early job (conftest.py:
    started at collection, off the suite's own process; the tests that read it run last)."""
    folder = work / "ddp"
    folder.mkdir()
    (folder / "train.py").write_text(DDP_TRAIN, encoding="utf-8")
    workers, env = warm_workers(torchrun_env())
    cmd = [*WARM_TORCHRUN, *workers, str(folder / "train.py"), str(folder / "out")]
    return {"ddp": run_to_end("ddp", cmd, folder, timeout_s=EARLY_TIMEOUT_S, env=env)}


@pytest.mark.slow
def test_under_ddp_a_nan_on_one_rank_is_a_skip_on_both_and_rank_0_writes(launches):
    """GuardedTrainer under torchrun, two CPU processes (gloo DDP), accumulation 2: a NaN loss in
    rank 1's second micro-batch of step 3 alone is the same skip on both ranks (the guard's one
    all-reduce), the replicas stay identical, HF's schedule holds on both, and rank 0 alone
    writes the CSV (the README said this was checked; no test held it). Then a SIGTERM to rank
    1's process alone at step 4's end stops both ranks after step 4, 143 each (the ranks agree
    at each step's end: rank 0 went on alone into step 5's all-reduce)."""
    done = launches["ddp"]
    assert done.rc == 0, done.stderr[-3000:]
    lines = dict(re.findall(r"rank (\d): (.*)", done.stdout))
    assert sorted(lines) == ["0", "1"], done.stdout
    assert lines["0"] == lines["1"]  # the same records, the same held LR, the same weights
    assert lines["0"].startswith("[(1, False, None), (2, False, None), (3, True, 'non_finite_loss'), (4, False, None)] ")
    assert dict(re.findall(r"rank (\d) stopped: (.*)", done.stdout)) == {
        "0": "143 interrupted (SIGTERM) after step 4", "1": "143 interrupted (SIGTERM) after step 4"}, done.stdout
    rows = read_rows(done.cwd / "out" / "ampguard" / "steps.csv")
    assert [(r["step"], r["skipped"], r["skip_reason"]) for r in rows] == [
        ("1", "0", ""), ("2", "0", ""), ("3", "1", "non_finite_loss"), ("4", "0", "")]
    lrs = [float(r["lr"]) for r in rows]
    assert lrs[1] > lrs[2] == lrs[3]  # HF's linear decay held on the skipped step


def test_a_training_step_overridden_without_super_is_refused_not_trained_unguarded(tmp_path):
    # HF's own recipe in a subclass (compute_loss, accelerator.backward): the guard was never built,
    # max_grad_norm was ignored (the guard's clip returned None), RUN.md said "guarded: yes", 0 rows
    class Mine(GuardedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            loss = self.compute_loss(model, self._prepare_inputs(inputs), num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(loss)
            return loss.detach()

    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = Mine(model=model, args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(8),
                   ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(RuntimeError, match=r"^GuardedTrainer: HF is about to step the optimizer, but no guarded step "
                                           r"closed this group: training_step is overridden without calling super"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing applied
    # no step recorded: the files this train() made are taken back (a corrected subclass starts afresh)
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()
    assert not (tmp_path / "out" / "ampguard" / "RUN.md").exists()


@pytest.mark.parametrize("how", ["accelerator.backward", "loss.backward"])
def test_a_backward_of_ones_own_after_the_guarded_step_is_refused_before_hf_applies_it(tmp_path, how):
    # an auxiliary loss after super().training_step: the guard had stepped and dropped the gradients,
    # and HF's optimizer.step() applied the aux ones as a second update, unchecked and unclipped
    # (a NaN in them reached the weights while the CSV said the step was clean)
    class Aux(GuardedTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            aux = sum(p.float().square().sum() for p in model.parameters())
            self.accelerator.backward(aux) if how == "accelerator.backward" else aux.backward()
            return loss

    model = tiny_gpt2()
    trainer = Aux(model=model, args=arguments(tmp_path, "fp32", steps=2, optim="adamw_torch"),
                  train_dataset=token_ids(8), ampguard=AmpGuardCallback(print_fn=lambda line: None))
    said = ("accelerator.backward() beside the guard" if how == "accelerator.backward"
            else "gradients made after the guarded step")
    with pytest.raises(RuntimeError, match=f"^GuardedTrainer: {re.escape(said)}"):
        trainer.train()
    assert trainer.guard.updates == 1
    assert {int(s["step"]) for s in trainer.guard.optimizer.state.values()} == {1}  # the guard's update alone


def test_a_custom_optimizer_over_part_of_the_model_trains_with_frozen_ignore(tmp_path):
    # GuardedTrainer's refusal said "pass frozen='ignore'", which it did not take (a TypeError)
    def trainer(**extra):
        model = tiny_gpt2()
        blocks = [p for name, p in model.named_parameters() if name.startswith("transformer.h.")]
        return model, GuardedTrainer(model=model, args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids(8),
                                     optimizers=(torch.optim.AdamW(blocks, lr=1e-2), None),
                                     ampguard=AmpGuardCallback(print_fn=lambda line: None), **extra)

    with pytest.raises(ValueError, match=r"requires grad but no optimizer updates it .* or pass frozen='ignore'"):
        trainer()[1].train()
    AcceleratorState._reset_state(reset_partial_state=True)
    # no step recorded: the files that train() made are taken back (review 33c: the corrected train()
    # the error asks for was refused "steps.csv already exists")
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()
    model, guarded = trainer(frozen="ignore")
    embedding = model.transformer.wte.weight.detach().clone()
    guarded.train()
    assert guarded.guard.updates == 2 and torch.equal(model.transformer.wte.weight, embedding)
    with pytest.raises(ValueError, match=r"^frozen must be 'refuse' or 'ignore', got 'skip'"):
        GuardedTrainer(model=model, args=arguments(tmp_path, "bf16"), train_dataset=token_ids(8), frozen="skip")


@pytest.mark.parametrize("trainer_class", ["GuardedTrainer", "Trainer + callback"])
def test_auto_find_batch_size_retries_after_an_out_of_memory_and_the_run_goes_on(tmp_path, trainer_class):
    # HF begins the training loop again with a smaller batch after an out-of-memory; each attempt
    # calls on_train_begin, which refused the CSV its first attempt had made ("already exists").
    # Here the first attempt trains two steps first: HF keeps the weights and optimizer state they
    # left, so their rows are kept aside, not cut (review_session14 B1)
    model = tiny_gpt2()
    forwards = [0]

    def out_of_memory(module, args, kwargs):
        forwards[0] += module.training
        if module.training and kwargs["input_ids"].shape[0] > 2 and forwards[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB (a stand-in)")

    model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    settings = dict(model=model, args=arguments(tmp_path, "bf16", steps=4, auto_find_batch_size=True),
                    train_dataset=token_ids())
    if trainer_class == "GuardedTrainer":
        trainer = GuardedTrainer(**settings)
        callback = trainer.ampguard
    else:
        callback = AmpGuardCallback()
        trainer = Trainer(**settings, callbacks=[callback])
    trainer.train()
    assert (trainer.state.global_step, trainer.state.train_batch_size) == (4, 2)
    # the last attempt's first forward noted the float32 map, and no dtype hook is left on the model
    assert callback.autocast_dtypes["transformer.wte"] == "float32"
    assert not any(m._forward_hooks for m in model.modules())
    folder = tmp_path / "out" / "ampguard"
    assert [int(r["step"]) for r in read_rows(folder / "steps.csv")] == [1, 2, 3, 4]
    events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
    retry = [e for e in events if e["event"] == "retry"]
    assert retry and all(e["step"] == 0 for e in retry)  # (HF tries 3, then 2)
    assert "train batch size of 2" in retry[-1]["message"]
    assert "its 2 rows moved to steps.attempt-1.csv" in retry[0]["message"]
    assert [int(r["step"]) for r in read_rows(folder / "steps.attempt-1.csv")] == [1, 2]
    assert json.loads((folder / "summary.json").read_text())["steps"] == 4
    if trainer_class == "GuardedTrainer":
        assert trainer.guard.steps == 4


def test_a_compiled_model_is_not_hooked_for_the_float32_map(tmp_path):
    """``torch_compile=True``: the dtype hooks were traced into the compiled forward and removed
    after it, so dynamo compiled the model a second time (3 graphs, 2 without the hooks; with
    Inductor a second build). A compiled model's map stays empty. (One GPT-2 block: dynamo traces
    each block's code anew, and one holds every layer kind a hook would be on.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    trainer = GuardedTrainer(model=tiny_gpt2(n_layer=1), train_dataset=token_ids(), args=arguments(
        tmp_path, "bf16", steps=2, torch_compile=True, torch_compile_backend="eager"))
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert trainer.autocast_dtypes == {}
    assert counters["stats"]["unique_graphs"] == 2  # (the forward, and the loss after a graph break)
    assert "float32 under autocast" not in (tmp_path / "out" / "ampguard" / "RUN.md").read_text()


def test_a_stock_trainer_asked_for_fp16_on_a_cpu_runs_no_autocast_and_names_no_float32_layer(tmp_path):
    # Accelerate makes no autocast for fp16 on a CPU: every layer computed in float32, and the card said
    # all of them were left in float32 "under autocast"
    callback = AmpGuardCallback(print_fn=lambda line: None)
    Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", steps=1), train_dataset=token_ids(),
            callbacks=[callback]).train()
    assert callback.autocast_dtypes == {}
    assert "float32 under autocast" not in (tmp_path / "out" / "ampguard" / "RUN.md").read_text()


def test_a_stock_trainers_first_forward_that_runs_out_of_memory_leaves_the_map_to_the_retry(tmp_path):
    """A stock Trainer tells no callback that a training step raised: the dtype hooks the callback
    opened around the first micro-batch stayed open, half the layers noted. The retry's
    on_train_begin closes them; the retry's first forward notes the whole map."""
    model = tiny_gpt2()

    def out_of_memory(module, args, output):  # half-way through the model, on the first attempt's batch size
        if module.training and output.shape[0] > 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB (a stand-in)")

    model.transformer.h[1].register_forward_hook(out_of_memory)
    hooks_at_begin = []

    class Count(TrainerCallback):  # (after the ampguard one: each attempt's on_train_begin as it leaves the model)
        def on_train_begin(self, args, state, control, **kwargs):
            hooks_at_begin.append(sum(len(m._forward_hooks) for m in model.modules()))

    callback = AmpGuardCallback()
    trainer = Trainer(model=model, args=arguments(tmp_path, "bf16", steps=2, auto_find_batch_size=True),
                      train_dataset=token_ids(), callbacks=[callback, Count()])
    trainer.train()
    assert trainer.state.train_batch_size == 2
    assert len(hooks_at_begin) > 1 and set(hooks_at_begin) == {1}  # each retry begins with the abandoned hooks gone
    dtypes = callback.autocast_dtypes
    assert dtypes["transformer.ln_f"] == "float32" and dtypes["lm_head"] == "bfloat16"  # after the raise's layer
    assert sum(len(m._forward_hooks) for m in model.modules()) == 1  # the test's own


def test_a_second_train_names_the_layers_its_own_first_forward_left_in_float32(tmp_path):
    # the map is each train()'s: a second one kept the first one's (its model may have changed since)
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", steps=2), train_dataset=token_ids())
    trainer.train()
    first = dict(trainer.autocast_dtypes)
    assert first["transformer.wte"] == "float32" and first["transformer.h.0.mlp.c_fc"] == "bfloat16"
    trainer.autocast_dtypes["transformer.wte"] = "float64"  # (left by the first train(): none the second computes)
    (tmp_path / "out" / "ampguard").rename(tmp_path / "first")  # (its records: the second train() writes its own)
    trainer.train()
    AcceleratorState._reset_state(reset_partial_state=True)
    assert trainer.autocast_dtypes == first
    card = (tmp_path / "out" / "ampguard" / "RUN.md").read_text()
    assert f"| float32 under autocast | {float32_layers_text(first)} |" in card
