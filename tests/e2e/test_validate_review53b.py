"""Review 53b: ``validate --checkpoint`` judged a checkpoint in a model built from other task
settings when its weights happened to fit (charlm's ``task.n_head`` changes no weight shape): a
model nobody trained, ACCEPTED, and its verdict keyed as the trained one's. The checkpoint's task
settings are now compared with the config's always (as ``train --resume`` compares them), the
batch size apart (it changes no model).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path

import pytest

from helpers import one_line_error

from ampguard.checkpointer import check_task_settings
from ampguard.cli import main
from ampguard.config import Config, plain_data
from ampguard.errors import AmpguardWarning, InputError

TINY = ("task.name=charlm", "task.n_layer=1", "task.n_embd=16", "task.block_size=16", "task.batch_size=4",
        "eval.batches=1")


@pytest.fixture(scope="module")
def charlm_n_head_2(tmp_path_factory) -> Path:
    """A 2-step fp32 charlm checkpoint trained with ``task.n_head=2`` (the default is 4: same shapes)."""
    runs = tmp_path_factory.mktemp("runs")
    sets = [*TINY, "task.n_head=2", "precision=fp32", "steps=2", f"log.dir={runs}", "log.name=h2"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["train", *(a for s in sets for a in ("--set", s))])
    assert code == 0
    path = runs / "h2" / "checkpoints" / "step-00000002.pt"
    assert path.is_file()
    return path


def validate_args(checkpoint: Path, out: str, *sets: str) -> list[str]:
    sets = (*TINY, "validation.precisions=[bf16]", "validation.min_accuracy=0", *sets)
    return ["validate", *(a for s in sets for a in ("--set", s)), "--checkpoint", str(checkpoint), "--out", out]


def test_a_checkpoint_of_other_task_settings_that_fit_is_refused(cli, tmp_path, charlm_n_head_2):
    line = one_line_error(*cli(*validate_args(charlm_n_head_2, "v")))  # n_head 4, the default: the weights fit
    assert line == (f"ampguard: error: {charlm_n_head_2}: it was trained with task.n_head 2, this config's is 4: "
                    "pass that run's config.yaml, or --set task.n_head=2"), line
    assert not (tmp_path / "v").exists()


def test_a_checkpoint_of_the_same_task_settings_is_judged(cli, tmp_path, charlm_n_head_2):
    # the batch size changes no model: another one is no refusal
    code, out, err = cli(*validate_args(charlm_n_head_2, "v", "task.n_head=2", "task.batch_size=2"))
    assert code in (0, 1), (out, err)  # a verdict (untrained, bf16 may flip a near-tie), not a refusal
    assert (tmp_path / "v" / "validation.json").is_file()


def test_a_factory_option_that_differs_is_said_not_refused():
    # a factory's own settings (a data path on this machine among them) load with a warning naming both
    with pytest.warns(AmpguardWarning, match=r"^a\.pt: it was trained with task\.options\.data /a, this config's is "
                                             r"/b: loaded under this config's"):
        check_task_settings({"config": {"task": {"factory": "m.py:build", "options": {"data": "/a"}}}},
                            {"factory": "m.py:build", "options": {"data": "/b"}}, "a.pt")


# ---------------------------------------------------------------------------- review 53i: the settings the task reads


def _task(**task) -> dict:
    """A config's ``task`` section as validate and locate pass it (plain_data's: a preset's sizes set)."""
    return plain_data(Config.model_validate({"task": task}))["task"]


GPT2_SIZES = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}


@pytest.mark.parametrize(("saved", "now"), [
    ({"preset": "gpt2-small"}, GPT2_SIZES),
    (GPT2_SIZES, {"preset": "gpt2-small"}),
    ({"name": "digits"}, {"name": "digits", "n_head": 8}),
    ({"name": "digits"}, {"name": "digits", "block_size": 32}),
    ({"name": "linear"}, {"name": "linear", "n_embd": 32}),
], ids=["preset-saved", "preset-now", "digits-n_head", "digits-block_size", "linear-n_embd"])
def test_a_checkpoint_of_the_same_model_is_loaded(saved, now):
    # review 53i: settings the task never reads (digits has no heads, linear no sizes) and a preset
    # against its own sizes spelled out were refused, though the model is the same; nothing is said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_task_settings({"config": {"task": _task(**saved)}}, _task(**now), "a.pt")


@pytest.mark.parametrize(("saved", "now", "line"), [
    ({"name": "digits"}, {"name": "digits", "n_embd": 32},
     "a.pt: it was trained with task.n_embd 64, this config's is 32: pass that run's config.yaml, "
     "or --set task.n_embd=64"),
    ({"preset": "gpt2-small"}, {**GPT2_SIZES, "n_head": 8},
     "a.pt: it was trained with task.n_head 12, this config's is 8: pass that run's config.yaml, "
     "or --set task.n_head=12"),
    # a config sized by the preset alone: --set task.n_head=8 would clash with it, preset=null alone
    # gives the default sizes: the hint names the preset's place and the run's four sizes
    ({**GPT2_SIZES, "n_head": 8}, {"preset": "gpt2-small"},
     "a.pt: it was trained with task.n_head 8, this config's is 12: pass that run's config.yaml, or --set "
     "task.preset=null --set task.n_layer=12 --set task.n_head=8 --set task.n_embd=768 --set task.block_size=1024"),
])
def test_a_setting_the_task_reads_is_still_compared(saved, now, line):
    with pytest.raises(InputError) as err:
        check_task_settings({"config": {"task": _task(**saved)}}, _task(**now), "a.pt")
    assert str(err.value) == line


@pytest.fixture(scope="module")
def digits_checkpoint(tmp_path_factory) -> Path:
    """A 2-step fp32 digits checkpoint (the default n_head, which digits does not read)."""
    runs = tmp_path_factory.mktemp("runs")
    sets = ["task.name=digits", "task.n_embd=8", "task.batch_size=16", "precision=fp32", "steps=2",
            f"log.dir={runs}", "log.name=d"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(["train", *(a for s in sets for a in ("--set", s))])
    assert code == 0
    return runs / "d" / "checkpoints" / "step-00000002.pt"


def test_validate_judges_a_digits_checkpoint_under_another_n_head(cli, tmp_path, digits_checkpoint):
    # review 53i (the reviewer's CLI case): digits reads no n_head; the checkpoint is its model
    # (rules an untrained model's near-ties pass: the verdict is ACCEPTED, exit 0; a refusal was exit 2)
    sets = ("task.name=digits", "task.n_embd=8", "task.n_head=8", "validation.precisions=[bf16]",
            "validation.min_accuracy=0", "validation.ties=accept", "validation.max_flips=100000",
            "validation.abs_tol=1", "validation.max_quality_drop=null")
    code, out, err = cli("validate", *(a for s in sets for a in ("--set", s)), "--checkpoint", str(digits_checkpoint),
                         "--out", "v")
    assert code == 0, (out, err)
    assert "does not read task.n_head" in err  # (said, as any setting the task does not read is)
    assert (tmp_path / "v" / "validation.json").is_file()
