"""Review 38c: the paths the Lightning plugin's ``csv=`` and the Hugging Face callback's ``out_dir``
are given, judged by one rule (``ampguard.errors.as_made``: what ``mkdir -p`` makes of the path,
walked as the OS walks it), each refused up front in one line or written; a group an epoch ended
inside, dropped though a reloaded loader gives the next epoch fewer batches; a resumed CSV that is
a symbolic link cut through the link; the callback's default ``out_dir`` checked when ``train()``
begins."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from helpers import read_rows

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from test_lightning import Digits, fit, loader, rows, same  # noqa: E402
from test_transformers_review import arguments, tiny_gpt2, token_ids  # noqa: E402

from ampguard import errors  # noqa: E402 - (the shared rule, errors.as_made, looked up when a test runs)
from ampguard.errors import AmpguardWarning, InputError  # noqa: E402
from ampguard.files import replace_atomically  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin, _check_writable  # noqa: E402
from ampguard.integrations.transformers import AmpGuardCallback, GuardedTrainer  # noqa: E402


def lab(root: Path) -> Path:
    """The reviewer's fixture folder: a file, a link to a folder, a link to nothing, a link to the
    file, a link to itself (resolved: the OS's answers are compared as paths)."""
    root.mkdir(parents=True)
    root = root.resolve()
    (root / "file.txt").write_text("mine")
    (root / "realdir" / "inner").mkdir(parents=True)
    (root / "linkdir").symlink_to(root / "realdir" / "inner")
    (root / "gone").symlink_to(root / "nowhere")
    (root / "linkfile").symlink_to(root / "file.txt")
    (root / "loop").symlink_to(root / "loop")
    return root


CASES = ["file.txt/..", "file.txt/../sub", "nodir/../file.txt/sub", "gone/../x", "gone", "gone/x", "nodir/..",
         "linkdir", "linkdir/../x", "nodir/../linkdir/x", "linkfile/x", "file.txt/sub", "loop", "loop/x",
         "linkdir/../../file.txt/x"]
MADE = {"nodir/..", "linkdir", "linkdir/../x", "nodir/../linkdir/x"}  # what os.makedirs makes of them


def makedirs_makes(folder: Path) -> bool:
    """The truth: whether ``os.makedirs(folder, exist_ok=True)`` makes or reaches a folder there."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return False
    return folder.is_dir()


@pytest.mark.parametrize("case", CASES)
def test_the_shared_rule_says_what_makedirs_does(tmp_path, case):
    root = lab(tmp_path / "lab")
    reached, problem = errors.as_made(root / case), errors.folder_problem(root / case)
    makes = makedirs_makes(root / case)  # (after the judgement: it makes folders)
    assert makes == (case in MADE)
    assert (problem is None) == makes, problem
    if makes:  # the folder the rule says it reaches is the one made
        assert reached.folder == Path(os.path.realpath(root / case)) and reached.blocked is None
    else:
        assert "\n" not in problem and problem.startswith(f"{root / case} ")
        assert problem.endswith(", not a folder") and reached.blocked is not None


@pytest.mark.parametrize("case", CASES)
def test_a_csv_folder_is_refused_before_any_update_or_written_as_makedirs_makes_it(tmp_path, case):
    # review 38c #1/#3: gone/steps.csv, gone/../x/steps.csv, nodir/../file.txt/sub/steps.csv (and a loop)
    # passed the up-front check, then failed at the first record, after an update
    root = lab(tmp_path / "lab")
    csv_path = root / case / "steps.csv"
    module, plugin = Digits(hidden=8), AmpGuardPlugin("32-true", csv=csv_path)
    before = module._params()
    if case in MADE:
        fit(module, plugin, steps=1, data=loader(n=32))
        assert [r["step"] for r in rows(csv_path)] == ["1"]
        return
    with pytest.raises(InputError) as refused:
        fit(module, plugin, steps=1, data=loader(n=32))
    said = str(refused.value)
    assert "\n" not in said and said.startswith(f"AmpGuardPlugin csv={str(csv_path)!r}: ")
    assert said.endswith(", not a folder"), said  # (errors.folder_problem's words, as the out_dir's)
    assert plugin.guard is None and module.trainer.global_step == 0 and same(module._params(), before)
    assert (root / "file.txt").read_text() == "mine" and not (root / "nowhere").exists()


@pytest.mark.parametrize("case", CASES)
def test_an_out_dir_is_refused_when_the_callback_is_made_or_written_as_makedirs_makes_it(tmp_path, case):
    # review 38c #2/#3: file.txt/.., file.txt/../sub and gone/../x were accepted, then train() died with a raw
    # NotADirectoryError / FileExistsError at its mkdir
    root = lab(tmp_path / "lab")
    out = root / case
    if case not in MADE:
        with pytest.raises(ValueError) as refused:
            AmpGuardCallback(out, print_fn=lambda line: None)
        assert "\n" not in str(refused.value)
        assert str(refused.value).startswith(f"AmpGuardCallback(out_dir=...): {out} ")
        assert (root / "file.txt").read_text() == "mine" and not (root / "nowhere").exists()
        return
    callback = AmpGuardCallback(out, print_fn=lambda line: None)
    GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp32", max_steps=1), train_dataset=token_ids(8),
                   ampguard=callback).train()
    assert [r["step"] for r in read_rows(out / "steps.csv")] == ["1"]


@pytest.mark.parametrize("name", ["gone", "loop"])
def test_a_csv_that_is_a_link_to_nothing_is_refused_before_any_update(tmp_path, name):
    # review 38c #1: csv=gone was "refusing to write through it" only at the first record, the weights changed
    root = lab(tmp_path / "lab")
    module, plugin = Digits(hidden=8), AmpGuardPlugin("32-true", csv=root / name)
    before = module._params()
    with pytest.raises(InputError) as refused:
        fit(module, plugin, steps=1, data=loader(n=32))
    what = (f"a symbolic link to {root / 'nowhere'}, which does not exist" if name == "gone"
            else "a symbolic link that loops")
    assert str(refused.value) == f"AmpGuardPlugin csv={str(root / name)!r}: that is {what}; refusing to write through it"
    assert plugin.guard is None and same(module._params(), before) and not (root / "nowhere").exists()


class ShrinkingEpochs(Digits):
    """Epoch 0 has 10 batches and ends at batch 3, inside the first group of 4
    (``on_train_batch_start`` returns -1); a reloaded loader gives epoch 1 three batches."""

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if self.current_epoch == 0 and batch_idx == 3 else None

    def train_dataloader(self):
        return loader(batch_size=16, n=160 if self.current_epoch == 0 else 48)


def test_a_group_an_epoch_ended_inside_is_dropped_though_the_next_epoch_has_fewer_batches():
    # review 38c #4: the dropped group's last micro-batch (2) was compared with the NEW epoch's 3 batches,
    # taken for an epoch run to its end, and the next backward raised "the gradients of micro-batch 3 of 4
    # were cleared inside the accumulation group"
    def train(module, plugin):
        trainer = L.Trainer(plugins=[plugin], max_epochs=2, accumulate_grad_batches=4, reload_dataloaders_every_n_epochs=1,
                            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_checkpointing=False, enable_model_summary=False)
        trainer.fit(module)
        return trainer

    module, plugin = ShrinkingEpochs(), AmpGuardPlugin("bf16-mixed", max_norm=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(module, plugin)
    said = [str(w.message) for w in caught if issubclass(w.category, AmpguardWarning)]
    assert any(line.startswith("AmpGuardPlugin: epoch 0's micro-batches 0-2 (3 of 4) had no optimizer step")
               for line in said), said
    plain = ShrinkingEpochs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lightning = train(plain, MixedPrecision("bf16-mixed", "cpu"))
    assert trainer.global_step == lightning.global_step == plugin.guard.steps == 1  # (epoch 1's short group)
    assert same(list(module.parameters()), list(plain.parameters()))  # bit for bit Lightning's own run


def test_a_resumed_csv_that_is_a_link_stays_a_link_and_its_target_is_cut(tmp_path):
    # review 38c #5: the cut (a new file renamed over the CSV) replaced the link by a file of its own; the
    # link's target kept the rows the resume abandoned
    (tmp_path / "real").mkdir()
    (tmp_path / "view").mkdir()
    target, link = tmp_path / "real" / "steps.csv", tmp_path / "view" / "steps.csv"
    target.touch()
    link.symlink_to(target)
    fit(Digits(hidden=8), AmpGuardPlugin("32-true", csv=link), steps=3).save_checkpoint(tmp_path / "at3.ckpt")
    fit(Digits(hidden=8), AmpGuardPlugin("32-true", csv=link), steps=5, ckpt_path=tmp_path / "at3.ckpt")
    assert link.is_symlink() and [r["step"] for r in rows(target)] == ["1", "2", "3", "4", "5"]
    fit(Digits(hidden=8), AmpGuardPlugin("32-true", csv=link), steps=4, ckpt_path=tmp_path / "at3.ckpt")
    assert link.is_symlink() and os.path.realpath(link) == str(target)
    assert [r["step"] for r in rows(target)] == ["1", "2", "3", "4"]  # steps 4-5 of the abandoned future cut
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["steps.csv"]  # (no temporary file left)
    assert sorted(p.name for p in (tmp_path / "view").iterdir()) == ["steps.csv"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a folder no file can be made in)")
def test_a_resumes_link_csv_is_checked_in_its_targets_folder(tmp_path):
    # review 38c #5: the rewrite happens in the folder of the file the link points at, not the link's
    link = tmp_path / "steps.csv"
    link.symlink_to("/proc/version")
    with pytest.raises(InputError, match=r"^csv: (no file can be made in /proc \(.*\)|/proc is not a folder this user "
                                         r"may write in), where a resume rewrites the CSV; give a csv path"):
        _check_writable(link, "csv", rewritten=True)


def test_replace_atomically_through_a_link_rewrites_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    target, link = tmp_path / "elsewhere" / "steps.csv", tmp_path / "steps.csv"
    target.write_text("step\n1\n2\n")
    link.symlink_to(Path("elsewhere") / "steps.csv")  # (a relative link)
    replace_atomically(link, "step\n1\n", through_link=True)
    assert link.is_symlink() and target.read_text() == "step\n1\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["elsewhere", "steps.csv", "steps.csv"]
    replace_atomically(link, "whole\n")  # (by default a link is replaced itself: its target is never written)
    assert not link.is_symlink() and link.read_text() == "whole\n" and target.read_text() == "step\n1\n"


def test_a_default_out_dir_that_is_a_file_is_refused_in_one_line_before_any_step(tmp_path):
    # review 38c #6: <output_dir>/ampguard a file was never checked: train() raised mkdir's raw FileExistsError
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ampguard").write_text("mine\n")
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GuardedTrainer(model=model, args=arguments(tmp_path, "fp32", max_steps=2), train_dataset=token_ids(16),
                             ampguard=AmpGuardCallback(print_fn=lambda line: None))
    with pytest.raises(InputError) as refused:
        trainer.train()
    assert str(refused.value) == (f"AmpGuardCallback: {tmp_path / 'out' / 'ampguard'} is a file, not a folder (the "
                                  "callback's default out_dir, <output_dir>/ampguard); give "
                                  "AmpGuardCallback(out_dir=...) a folder")
    assert trainer.state.global_step == 0 and same(list(model.parameters()), before)
    assert (tmp_path / "out" / "ampguard").read_text() == "mine\n"


def test_an_out_dir_made_a_file_after_the_callback_is_refused_when_train_begins(tmp_path):
    # review 38c #6: the folder is judged again when train() begins (the constructor's check was of then)
    out = tmp_path / "guard"
    callback = AmpGuardCallback(out, print_fn=lambda line: None)
    out.write_text("mine\n")
    trainer = GuardedTrainer(model=tiny_gpt2(), args=arguments(tmp_path, "fp32", max_steps=2),
                             train_dataset=token_ids(16), ampguard=callback)
    with pytest.raises(InputError, match=rf"^AmpGuardCallback\(out_dir=\.\.\.\): {re.escape(str(out))} is a file, "
                                         r"not a folder$"):
        trainer.train()
    assert trainer.state.global_step == 0 and out.read_text() == "mine\n"
