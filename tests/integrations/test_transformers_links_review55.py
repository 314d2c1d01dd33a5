"""Review 55d F4: the Hugging Face callback's ``summary.json`` and ``RUN.md`` are replaced whole
(``files.replace_atomically``), as ``train`` writes its own: a link at either name (another user's,
in a shared ``out_dir``) is replaced, never written through, and a kill mid-write leaves no half a
card."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments  # noqa: E402

from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def test_the_card_and_summary_replace_links_at_their_names_and_never_write_through_them(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("RUN.md", "summary.json"):
        (elsewhere / name).write_text("PRECIOUS\n", encoding="utf-8")
        (out / name).symlink_to(elsewhere / name)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    ids = [{"input_ids": t, "labels": t} for t in torch.randint(0, 32, (16, 8))]
    args = TrainingArguments(str(tmp_path / "hf"), per_device_train_batch_size=4, max_steps=2, use_cpu=True,
                             report_to=[], save_strategy="no", disable_tqdm=True)
    GuardedTrainer(model=model, args=args, train_dataset=ids,
                   ampguard=AmpGuardCallback(out, print_fn=lambda line: None)).train()
    for name in ("RUN.md", "summary.json"):
        assert (elsewhere / name).read_text(encoding="utf-8") == "PRECIOUS\n"
        assert not (out / name).is_symlink()
    assert json.loads((out / "summary.json").read_text(encoding="utf-8"))["steps"] == 2
    assert "finished: 2 steps" in (out / "RUN.md").read_text(encoding="utf-8")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # (no temporary file left)
