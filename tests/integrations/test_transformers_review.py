"""Review 37c of the Hugging Face Trainer integration, against the real transformers: a tiny GPT-2
on the CPU. A stock fp16 checkpoint's ``scaler.pt`` under GuardedTrainer; a resume without
ampguard's state judged over the steps the monitor saw; a stop flag set inside a group named as
the cause; an ``out_dir`` that is a file refused when the callback is made. Review 37h: ``ampguard
report`` counts a resumed run's steps as its card does; a header-only ``steps.csv``, a resume that
observed no step, a scale past float32 and an ``out_dir`` link or unsearchable parent said rightly."""

from __future__ import annotations

import json
import re
import shutil
import warnings

import pytest
import torch

from helpers import read_rows

transformers = pytest.importorskip("transformers")
from accelerate.state import AcceleratorState  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ampguard.errors import InputError  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def token_ids(n: int = 40) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 32, (n, 1), generator=g)
    return [{"input_ids": ids, "labels": ids} for ids in ((starts + torch.arange(8)) % 32)]


def arguments(tmp_path, precision: str, **extra) -> TrainingArguments:
    settings = dict(per_device_train_batch_size=4, use_cpu=True, report_to=[], logging_steps=100,
                    save_strategy="no", learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=0,
                    max_grad_norm=1.0, fp16=precision == "fp16", bf16=precision == "bf16", disable_tqdm=True, seed=0)
    return TrainingArguments(str(tmp_path / "out"), **{**settings, **extra})


def stock_checkpoint(tmp_path, step: int, steps: int) -> str:
    """A stock fp32 Trainer's ``checkpoint-<step>`` (no ampguard state, no callback files)."""
    Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp32", max_steps=steps, save_strategy="steps",
                                               save_steps=step), train_dataset=token_ids(200)).train()
    AcceleratorState._reset_state(reset_partial_state=True)
    return str(tmp_path / "out" / f"checkpoint-{step}")


def events(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "ampguard" / "events.jsonl").read_text().splitlines()]


def summary(tmp_path) -> dict:
    return json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text(encoding="utf-8"))


def test_a_stock_fp16_checkpoints_scaler_pt_gives_guarded_trainer_its_starting_scale(tmp_path):
    # review 37c d1: HF's _load_scaler loaded scaler.pt into Accelerate's scaler, None under
    # GuardedTrainer (mixed_precision="no"): an AttributeError traceback
    checkpoint = stock_checkpoint(tmp_path, 2, 4)
    # what a stock fp16 Trainer on a GPU saves beside optimizer.pt: its GradScaler's state
    torch.save(torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict(), f"{checkpoint}/scaler.pt")
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", max_steps=4),
                             train_dataset=token_ids(200), ampguard=AmpGuardCallback(print_fn=lambda line: None))
    trainer.train(resume_from_checkpoint=checkpoint)
    rows = read_rows(tmp_path / "out" / "ampguard" / "steps.csv")
    assert [(r["step"], r["skipped"], r["scaler_scale"]) for r in rows] == [("3", "0", "1024.0"), ("4", "0", "1024.0")]
    resumed = next(e for e in events(tmp_path) if e["event"] == "resume")
    # (review 54s: its growth tracker too, and the settings kept named: GuardedTrainer's default init_scale only differs)
    assert ("the loss scale takes over its scaler.pt (the stock Trainer's GradScaler's): scale 1024 and growth "
            "tracker 0; the monitor") in resumed["message"]
    # a stock scale below the guard's floor (min_scale 1.0 by default) is raised to it, and said so
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.save(torch.amp.GradScaler("cpu", init_scale=0.25).state_dict(), f"{checkpoint}/scaler.pt")
    shutil.rmtree(tmp_path / "out" / "ampguard")
    GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", max_steps=4), train_dataset=token_ids(200),
                   ampguard=AmpGuardCallback(print_fn=lambda line: None)).train(resume_from_checkpoint=checkpoint)
    assert read_rows(tmp_path / "out" / "ampguard" / "steps.csv")[0]["scaler_scale"] == "1.0"
    assert "scale 1 (the checkpoint's 0.25 raised to min_scale 1) and growth tracker 0;" in next(
        e for e in events(tmp_path) if e["event"] == "resume")["message"]
    # a bf16 run has no loss scaler: the file is not used, and said so
    AcceleratorState._reset_state(reset_partial_state=True)
    shutil.rmtree(tmp_path / "out" / "ampguard")
    GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", max_steps=4), train_dataset=token_ids(200),
                   ampguard=AmpGuardCallback(print_fn=lambda line: None)).train(resume_from_checkpoint=checkpoint)
    assert "its scaler.pt (a stock fp16 Trainer's loss scale) is not used: this bf16 run has no loss scaler" in next(
        e for e in events(tmp_path) if e["event"] == "resume")["message"]
    # a scaler.pt that is no scaler's state: one line naming the file, before anything is written
    AcceleratorState._reset_state(reset_partial_state=True)
    shutil.rmtree(tmp_path / "out" / "ampguard")
    (tmp_path / "out" / "checkpoint-2" / "scaler.pt").write_bytes(b"not a pickle")
    with pytest.raises(InputError, match=r"checkpoint-2/scaler\.pt: not a loss scaler's state \(HF's scaler\.pt\): "):
        GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", max_steps=4), train_dataset=token_ids(200),
                       ampguard=AmpGuardCallback(print_fn=lambda line: None)).train(resume_from_checkpoint=checkpoint)
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()


def test_a_resume_without_ampguard_state_is_judged_over_the_steps_the_monitor_saw(tmp_path):
    # review 37c d2: the fresh monitor took the checkpoint's step as steps seen: two all-skipped
    # steps after resuming at 6 of 8 were judged as 2/8 (exit 0), where a run of those two alone
    # fails (exit 3); and it warned of "steps.csv's rows end at step 0 ... a copied steps.csv?"
    checkpoint = stock_checkpoint(tmp_path, 6, 8)
    model = tiny_gpt2()
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp32", max_steps=8), train_dataset=token_ids(200),
                             ampguard=AmpGuardCallback(fail_rate=0.5, print_fn=lambda line: None))
    model.transformer.wte.weight.register_hook(lambda g: torch.full_like(g, float("inf")))  # every step overflows
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=checkpoint)
    assert not [w for w in said if "rows end at step" in str(w.message)]
    got = summary(tmp_path)
    assert (got["exit_code"], got["cause"], got["steps"], got["updates"], got["skips"], got["unobserved"]) == (
        3, "skip_rate", 8, 0, {"non_finite_grad": 2}, 6)
    assert "at every one of the 2 steps after step 6" in got["ended"]
    card = (tmp_path / "out" / "ampguard" / "RUN.md").read_text(encoding="utf-8")
    assert "| steps / updates applied | 8 / 0 (steps 1 to 6 not counted: resumed from a checkpoint without " in card
    resumed = next(e for e in events(tmp_path) if e["event"] == "resume")
    assert resumed["message"].endswith("the monitor observes from step 7 (its counts and judgement leave steps 1 to 6 "
                                       f"out); there was no steps.csv in {tmp_path / 'out' / 'ampguard'} to go on: its "
                                       "rows begin at step 7")


def test_a_stock_trainer_resumed_with_the_callback_counts_the_steps_it_watched(tmp_path):
    # review 37c d2b: "steps / updates 4 / 2" with no skip (2 steps neither applied nor skipped)
    def stock():
        return Trainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp32", max_steps=4, save_strategy="steps",
                                                         save_steps=2),
                       train_dataset=token_ids(200), callbacks=[AmpGuardCallback(print_fn=lambda line: None)])

    with pytest.warns(UserWarning):
        stock().train()
    shutil.rmtree(tmp_path / "out" / "checkpoint-4")
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.warns(UserWarning) as said:
        stock().train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert not [w for w in said if "rows end at step" in str(w.message)]  # (the CSV goes on from row 2)
    got = summary(tmp_path)
    assert (got["steps"], got["updates"], got["skips"], got["unobserved"]) == (4, 2, {}, 2)
    assert got["summary"].startswith("steps=4 (1 to 2 not observed) updates=2 skips=0")
    assert [r["step"] for r in read_rows(tmp_path / "out" / "ampguard" / "steps.csv")] == ["1", "2", "3", "4"]
    # review 37h d1 (r10): the card said "steps 1 to 2 not observed" of rows steps.csv shows, and
    # `ampguard report` counted all four; now the card says they are not counted, and report, reading
    # summary.json's `unobserved`, counts the same two steps (the monitor does not replay the rows:
    # another process's monitor, without the CSV, would judge otherwise and stop alone under DDP)
    card = (tmp_path / "out" / "ampguard" / "RUN.md").read_text(encoding="utf-8")
    assert "| steps / updates applied | 4 / 2 (steps 1 to 2 not counted: resumed from a checkpoint without " in card
    assert "the counts and rates here cover steps 3 to 4) |" in card
    # (also noticed: the card's clip rate was 0 where a stock Trainer shows no pre-clip norm; report: n/a)
    assert "| clip rate | n/a (a stock Trainer shows the callback no pre-clip norm) |" in card
    out = reported(tmp_path)
    assert f"summary: {got['summary']}\n" in out and "ended: finished: 4 steps (exit 0)\n" in out
    assert "the CSV's 2 rows of those steps are drawn, not counted" in out


def reported(tmp_path, *flags: str) -> str:
    """What ``ampguard report out/ampguard --no-plot`` prints."""
    import contextlib
    import io

    from ampguard.cli import main

    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main(["report", str(tmp_path / "out" / "ampguard"), "--no-plot", *flags]) == 0
    return said.getvalue()


def test_a_resume_without_ampguard_state_after_one_that_raised_at_once_is_judged_alike_by_report(tmp_path):
    # review 37h: d3 (r13) the crashed resume's card said "the counts and rates here cover steps 7
    # to 6", clip rate 0; d2 (r11) the next resume warned "steps.csv's rows end at step 0 ... an
    # older or a copied steps.csv?" of the header the first left; d1 (r2) report replayed the rows
    # with a plain monitor: 2 skips of 10 steps, no alert, where the run alerted on 2 of 4
    checkpoint = stock_checkpoint(tmp_path, 6, 6)
    model = tiny_gpt2()
    raising = model.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(ValueError("bad batch")))
    with warnings.catch_warnings(), pytest.raises(ValueError, match="bad batch"):
        warnings.simplefilter("ignore")
        GuardedTrainer(model=model, args=arguments(tmp_path, "fp32", max_steps=10), train_dataset=token_ids(200),
                       ampguard=AmpGuardCallback(print_fn=lambda line: None)).train(resume_from_checkpoint=checkpoint)
    AcceleratorState._reset_state(reset_partial_state=True)
    card = (tmp_path / "out" / "ampguard" / "RUN.md").read_text(encoding="utf-8")
    assert "state, the monitor observed from step 7, as `ampguard report` counts; no step after it was observed) |" \
        in card
    assert "| clip rate | n/a (no step observed) |" in card
    raising.remove()
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp32", max_steps=10), train_dataset=token_ids(200),
                             ampguard=AmpGuardCallback(alert_rate=0.2, min_steps=6, print_fn=lambda line: None))
    model.transformer.wte.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if trainer.state.global_step in (6, 7) else g)  # steps 7, 8
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=checkpoint)
    assert not [w for w in said if "rows end at step" in str(w.message)]
    resumed = [e for e in events(tmp_path) if e["event"] == "resume"][-1]
    assert resumed["message"].endswith(f"steps.csv in {tmp_path / 'out' / 'ampguard'} had no row to go on: its rows "
                                       "begin at step 7")
    got = summary(tmp_path)
    assert (got["unobserved"], got["skips"], got["alert_episodes"], got["clip_rate"]) == (
        6, {"non_finite_grad": 2}, 1, 0.5)
    out = reported(tmp_path, "--alert-rate", "0.2", "--min-steps", "6")
    assert f"summary: {got['summary']}\n" in out
    assert "alert episodes 1 (re-judged at --alert-rate 0.2, --min-steps 6), clip rate 0.500," in out


def test_a_stock_scaler_pt_scale_past_float32_is_refused_naming_the_file(tmp_path):
    # review 37h d4 (r9): a scale of 1e39 escaped as a bare ValueError naming no file
    checkpoint = stock_checkpoint(tmp_path, 2, 2)
    state = torch.amp.GradScaler("cpu").state_dict()
    torch.save({**state, "scale": 1e39}, f"{checkpoint}/scaler.pt")
    with pytest.raises(InputError, match=r"checkpoint-2/scaler\.pt: not a loss scale to go on from: scale is 1e\+39"):
        GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp16", max_steps=4), train_dataset=token_ids(200),
                       ampguard=AmpGuardCallback(print_fn=lambda line: None)).train(resume_from_checkpoint=checkpoint)
    assert not (tmp_path / "out" / "ampguard" / "steps.csv").exists()


class EndTheEpochMidGroup(TrainerCallback):
    """``control.should_epoch_stop`` after the 2nd micro-batch of the 2nd group (of 3) of epoch 0."""

    def __init__(self):
        self.substeps = 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.substeps += 1
        if self.substeps == 4 and state.epoch < 1:
            control.should_epoch_stop = True


def test_an_epoch_stopped_inside_a_group_is_refused_naming_the_stop_flag(tmp_path):
    # review 37c e3: the RuntimeError blamed the dataset ("give the dataset a length")
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp32", num_train_epochs=2,
                                                               gradient_accumulation_steps=3),
                             train_dataset=token_ids(), callbacks=[EndTheEpochMidGroup()],
                             ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(RuntimeError, match=r"^GuardedTrainer: the epoch ended after micro-batch 2 of the 3 in a group "
                                           r"\(control\.should_epoch_stop set between a group's micro-batches"):
        trainer.train()
    assert trainer.state.global_step == 1  # (the broken group was not applied)
    got = summary(tmp_path)
    assert got["exit_code"] == 1 and got["ended"].startswith("crashed after step 1: RuntimeError: GuardedTrainer: the "
                                                             "epoch ended after micro-batch 2 of the 3")


@pytest.mark.parametrize("under", ["", "guard"])
def test_an_out_dir_that_is_a_file_or_under_one_is_refused_when_the_callback_is_made(tmp_path, under):
    # review 37c d4: accepted, then a raw FileExistsError / NotADirectoryError from mkdir in train()
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n", encoding="utf-8")
    out = notes / under if under else notes
    said = f"{notes} is a file, not a folder" if not under else f"{out} lies under {notes}, a file, not a folder"
    with pytest.raises(ValueError, match=rf"^AmpGuardCallback\(out_dir=\.\.\.\): {re.escape(said)}$"):
        AmpGuardCallback(out)
    assert notes.read_text(encoding="utf-8") == "mine\n"
    AmpGuardCallback(tmp_path / "new" / "deeper")  # a folder train() makes, with its parents: fine


def test_an_out_dir_that_is_a_broken_link_a_loop_or_not_searchable_is_refused_in_one_line(tmp_path):
    # review 37h d5 (r7, r8): a dangling link and a loop were "a file, not a folder"; a parent this
    # user may not search raised a raw PermissionError from AmpGuardCallback(...)
    import errno
    import os
    from unittest import mock

    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for out, said in ((tmp_path / "gone", f"is a symbolic link to {tmp_path / 'nowhere'}, which does not exist, "
                                          "not a folder"),
                      (tmp_path / "loop", "is a symbolic link that loops, not a folder"),
                      (tmp_path / "loop" / "sub", f"lies under {tmp_path / 'loop'}, a symbolic link that loops, "
                                                  "not a folder")):
        with pytest.raises(ValueError, match=rf"^AmpGuardCallback\(out_dir=\.\.\.\): {re.escape(f'{out} {said}')}$"):
            AmpGuardCallback(out)
    locked, stat = tmp_path / "locked", os.stat

    def refused(path, *args, **kwargs):  # (what a user who may not search `locked` meets; root passes modes)
        if str(path).startswith(f"{locked}/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return stat(path, *args, **kwargs)

    with mock.patch("os.stat", refused), pytest.raises(
            ValueError, match=rf"^AmpGuardCallback\(out_dir=\.\.\.\): {re.escape(str(locked / 'in'))} cannot be "
                              r"looked at: Permission denied$"):  # (the path once: review 39c)
        AmpGuardCallback(locked / "in")


def test_an_out_dir_through_dot_dot_or_a_link_through_a_file_is_named_rightly(tmp_path):
    # review 37p: nodir/../file.txt/guard walked up to the working folder and passed (then mkdir's raw
    # FileExistsError, a stray nodir/ made); a link through a file was called "a symbolic link that loops"
    from ampguard.integrations.transformers import _check_out_dir

    (tmp_path / "file.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"lies under .*file\.txt, a file, not a folder"):
        _check_out_dir(tmp_path / "nodir" / ".." / "file.txt" / "guard")
    (tmp_path / "via").symlink_to(tmp_path / "file.txt" / "sub")
    with pytest.raises(ValueError, match=r"via is a symbolic link to .*file\.txt/sub, which goes through a file"):
        _check_out_dir(tmp_path / "via")


def test_an_out_dir_through_a_link_and_dot_dot_is_judged_where_mkdir_makes_it(tmp_path):
    # review 37q: normalising the text took link/.. for the link's own parent, not its target's
    from ampguard.integrations.transformers import _check_out_dir

    (tmp_path / "deep" / "b").mkdir(parents=True)
    (tmp_path / "deep" / "file.txt").mkdir()  # (a folder there)
    (tmp_path / "deep" / "real.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("mine")  # (a file here)
    (tmp_path / "a").symlink_to(tmp_path / "deep" / "b")
    _check_out_dir(tmp_path / "a" / ".." / "file.txt" / "guard")  # (mkdir -p makes deep/file.txt/guard)
    with pytest.raises(ValueError, match=r"lies under .*real\.txt, a file, not a folder"):
        _check_out_dir(tmp_path / "a" / ".." / "real.txt" / "guard")
