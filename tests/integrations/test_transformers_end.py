"""The Hugging Face adapter judges a run too short for the rolling rules at its end, as
``ampguard train`` does (``RunMonitor.at_end``): a tiny GPT-2 on the CPU whose every step skips."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from ampguard.errors import InputError  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def _run(tmp_path, steps: int, bad: set[int], **monitor) -> dict:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    ids = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (64, 8))]
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=steps, use_cpu=True,
                             report_to=[], save_strategy="no", bf16=True, disable_tqdm=True)
    trainer = GuardedTrainer(model=model, args=args, train_dataset=ids,
                             ampguard=AmpGuardCallback(tmp_path / "out" / "ampguard", **monitor))
    model.transformer.wte.weight.register_hook(  # inf into the gradient of these optimizer steps
        lambda g: torch.full_like(g, float("inf")) if trainer.state.global_step + 1 in bad else g)
    trainer.train()
    return json.loads((tmp_path / "out" / "ampguard" / "summary.json").read_text(encoding="utf-8"))


def test_a_run_whose_every_step_skipped_alerts_at_its_end_and_fails_with_a_fail_rate(tmp_path):
    summary = _run(tmp_path / "a", 5, set(range(1, 6)))
    assert (summary["skips"], summary["alert_episodes"], summary["exit_code"]) == ({"non_finite_grad": 5}, 1, 0)
    events = [json.loads(line) for line in
              (tmp_path / "a" / "out" / "ampguard" / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [(e["event"], e["step"]) for e in events if e["event"] == "skip_rate_alert"] == [("skip_rate_alert", 5)]

    summary = _run(tmp_path / "b", 5, set(range(1, 6)), fail_rate=0.5)
    assert summary["exit_code"] == 3 and summary["cause"] == "skip_rate"
    assert summary["ended"].startswith("stopped by a guard at the end of the run (step 5): skip rate above fail_rate")

    summary = _run(tmp_path / "c", 5, {3}, fail_rate=0.5)  # 1 of 5: above alert_rate, never all above fail_rate
    assert (summary["alert_episodes"], summary["exit_code"], summary["ended"]) == (1, 0, "finished: 5 steps")


def test_summary_records_the_thresholds_its_monitor_judged_by_and_report_reads_them(tmp_path):
    from ampguard.report import thresholds_of

    summary = _run(tmp_path, 3, set(), window=16, alert_rate=0.25, min_steps=4)
    assert summary["thresholds"] == {"window": 16, "alert_rate": 0.25, "min_steps": 4, "growth_interval": None}
    assert thresholds_of(tmp_path / "out" / "ampguard" / "steps.csv") == {"window": 16, "alert_rate": 0.25,
                                                                           "min_steps": 4}


def test_a_resume_after_a_refused_train_is_a_resume_not_an_out_of_memory_retry(tmp_path):
    # (review 48g: with auto_find_batch_size a refused train() left its monitor un-ended; the resume that
    # followed, at the checkpoint's smaller batch, read as a retry: no resume event, a steps.attempt-1.csv,
    # and the sinks got no row)
    from transformers import Trainer

    from ampguard.sinks import JsonlSink

    def model():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))

    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (64, 8))]
    args = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=8, auto_find_batch_size=True,
                             max_steps=4, use_cpu=True, report_to=[], save_strategy="steps", save_steps=2,
                             disable_tqdm=True)
    first = model()  # its batch of 8 runs out of memory: HF's retry trains at 4, the checkpoints say so
    first.transformer.wte.register_forward_hook(lambda m, i, o: _out_of_memory() if i[0].shape[0] == 8 else o)
    Trainer(model=first, args=args, train_dataset=data, callbacks=[AmpGuardCallback(print_fn=lambda line: None)]).train()
    sink = JsonlSink(tmp_path / "rows.jsonl")
    trainer = Trainer(model=model(), args=args, train_dataset=data,
                      callbacks=[AmpGuardCallback(print_fn=lambda line: None, sinks=[sink])])
    with pytest.raises(InputError, match="steps.csv already exists"):
        trainer.train()
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    folder = tmp_path / "out" / "ampguard"
    events = [json.loads(line)["event"] for line in (folder / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    assert events[-2:] == ["resume", "run_end"] and "steps.attempt-1.csv" not in {p.name for p in folder.iterdir()}
    assert len((tmp_path / "rows.jsonl").read_text(encoding="utf-8").splitlines()) == 2  # steps 3 and 4


def _out_of_memory():
    raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
