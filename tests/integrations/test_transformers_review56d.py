"""Review 56d: the Hugging Face Trainer's files. F1: its RUN.md did not escape ``|`` (a module's
name in "float32 under autocast", an error message in "ended"), so a Markdown view cut the cell and
``read_card`` lost the row. F2: GuardedTrainer's ``ampguard_state.json`` held ``Infinity`` after a
skipped step (the monitor's last record), which ``JSON.parse``, polars or jq cannot read."""

from __future__ import annotations

import json

import pytest
import torch

from test_transformers_review import arguments, summary, tiny_gpt2, token_ids

pytest.importorskip("transformers")
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer, run_card  # noqa: E402
from ampguard.report import read_card, trainer_card_ended  # noqa: E402

CRASH = "crashed after step 6: ValueError: column a | b does not fit"


def test_the_trainer_card_keeps_a_pipe_in_its_cells_and_reads_back(tmp_path):
    card = tmp_path / "RUN.md"
    card.write_text(run_card({"ended": CRASH, "exit_code": 1, "steps": 6, "updates": 6, "clip_rate": 0.5,
                              "guarded": True, "float32_under_autocast": "parts.emb|x (1 of 2 layers)"}))
    rows = [line for line in card.read_text().splitlines() if line.startswith("| ")]
    assert f"| ended | {CRASH.replace('|', chr(92) + '|')} (exit 1) |" in rows
    _, table = read_card(card)
    assert trainer_card_ended(card) == table["ended"] == f"{CRASH} (exit 1)"
    assert table["float32 under autocast"] == "parts.emb|x (1 of 2 layers)"
    assert table["steps / updates applied"] == "6 / 6"  # (an ordinary row as it was)


def _strict(text: str) -> dict:
    def refuse(token: str) -> None:
        raise ValueError(f"not strict JSON: {token}")
    return json.loads(text, parse_constant=refuse)


def test_a_checkpoint_after_a_skipped_step_is_strict_json_and_resumes(tmp_path):
    def trainer(steps: int, **extra) -> GuardedTrainer:
        return GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "bf16", max_steps=steps, **extra),
                              train_dataset=token_ids(), ampguard=AmpGuardCallback(print_fn=lambda line: None))

    first = trainer(2, save_strategy="steps", save_steps=2)
    first.model.transformer.wte.weight.register_hook(  # (step 2's gradient overflows: a skipped step)
        lambda g: torch.full_like(g, float("inf")) if first.state.global_step + 1 == 2 else g)
    first.train()
    state = _strict((tmp_path / "out" / "checkpoint-2" / "ampguard_state.json").read_text(encoding="utf-8"))
    assert state["monitor"]["last"]["grad_l2_pre_clip"] == "inf" and state["monitor"]["skips"] == {"non_finite_grad": 1}
    _strict((tmp_path / "out" / "ampguard" / "summary.json").read_text(encoding="utf-8"))
    trainer(3).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    got = summary(tmp_path)
    assert (got["exit_code"], got["steps"], got["updates"], got["skips"], got["unobserved"]) == (
        0, 3, 2, {"non_finite_grad": 1}, 0)
