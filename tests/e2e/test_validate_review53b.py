"""Review 53b: ``validate --checkpoint`` judged a checkpoint in a model built from other task
settings when its weights happened to fit (charlm's ``task.n_head`` changes no weight shape): a
model nobody trained, ACCEPTED, and its verdict keyed as the trained one's. The checkpoint's task
settings are now compared with the config's always (as ``train --resume`` compares them), the
batch size apart (it changes no model).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from helpers import one_line_error

from ampguard.checkpointer import check_task_settings
from ampguard.cli import main
from ampguard.errors import AmpguardWarning

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
