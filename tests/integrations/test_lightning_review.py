"""AmpGuardPlugin against review 37j: Lightning's own skipped backward (StochasticWeightAveraging),
an epoch ended inside an accumulation group, a ``LightningModule.backward`` override (honoured,
handed the scaled and checked loss), ``manual_backward``'s arguments, and the
arguments that were taken and failed only after the first update."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import StochasticWeightAveraging  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from test_lightning import Digits, fit, loader, rows, same  # noqa: E402

from ampguard.errors import AmpguardWarning, InputError  # noqa: E402
from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.sinks import JsonlSink  # noqa: E402


class WithBatchNorm(Digits):
    """Digits with a BatchNorm layer (what makes SWA add its epoch without backward)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
        self.after = {0: self._params()}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_swas_epoch_without_backward_is_counted_with_no_update_and_no_record(tmp_path, precision):
    # 37j #1: SWA's last epoch (fit_loop._skip_backward, the whole epoch one group) made Lightning call
    # optimizer_step with a loss and no backward: "no backward ran before this optimizer step" ended the fit
    def swa_fit(plugin):
        module, swa = WithBatchNorm(lr=0.1), StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = fit(module, plugin, steps=-1, data=loader(batch_size=32, n=128), max_epochs=3, callbacks=[swa])
        return module, swa, trainer

    path = tmp_path / "steps.csv"
    module, swa, trainer = swa_fit(plugin := AmpGuardPlugin(precision, csv=path))
    _, _, plain = swa_fit(MixedPrecision(precision, "cpu"))
    assert trainer.global_step == plain.global_step == 3 * 4 + 1  # (SWA's epoch: one step, Lightning counts it)
    # the step without backward is counted (the numbering stays Lightning's) and recorded nowhere, as a
    # training_step returning None
    assert plugin.guard.steps == trainer.global_step
    assert [r.step for r in plugin.records] == [int(r["step"]) for r in rows(path)] == list(range(1, 13))
    # no update in that epoch: the weights are SWA's average, as it set them for its BatchNorm pass
    # (Lightning's own plugin steps the optimizer there on the gradients the last step left)
    assert same(list(module.parameters()), list(swa._average_model.parameters()))


class EndsEpochAt(Digits):
    """``on_train_batch_start`` returns -1 at batch ``cut`` (Lightning: the rest of the epoch skipped)."""

    def __init__(self, cut, **kw):
        super().__init__(**kw)
        self.cut = cut

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == self.cut else None


def test_an_epoch_ended_inside_an_accumulation_group_drops_the_group_as_lightning_does(tmp_path):
    # 37j #2: the next epoch's first backward raised "gradients cleared inside the accumulation group ...
    # remove zero_grad() from the loop", blaming the user for Lightning's own zero_grad
    path = tmp_path / "steps.csv"
    module = EndsEpochAt(5)  # batches 0-3 one group, 4 opens the next, 5 ends the epoch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(module, plugin := AmpGuardPlugin("bf16-mixed", csv=path), steps=-1,
                      data=loader(batch_size=16, n=160), max_epochs=2, accumulate_grad_batches=4)
    said = [str(w.message) for w in caught if issubclass(w.category, AmpguardWarning)]
    assert "AmpGuardPlugin: epoch 0's micro-batch 4 (1 of 4) had no optimizer step (the epoch ended inside the " \
           "group: on_train_batch_start returned -1?); dropped, as Lightning drops them (its zero_grad at the next " \
           "group's start)" in said
    assert "AmpGuardPlugin: the fit ended inside an accumulation group: epoch 1's micro-batch 4 (1 of 4) had no " \
           "optimizer step, as under Lightning" in said
    assert trainer.global_step == plugin.guard.steps == plugin.guard.updates == 2
    assert [int(r["step"]) for r in rows(path)] == [1, 2]
    plain = EndsEpochAt(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(plain, MixedPrecision("bf16-mixed", "cpu"), steps=-1, data=loader(batch_size=16, n=160), max_epochs=2,
            accumulate_grad_batches=4)
    assert plain.trainer.global_step == 2
    assert same(list(module.parameters()), list(plain.parameters()))  # bit for bit Lightning's own run


class LoggedBackward(Digits):
    """A ``backward`` override that notes the loss it is handed, then backwards it (a log, a
    context around it: what overrides do)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.handed = []

    def backward(self, loss, *args, **kwargs):
        self.handed.append(loss.detach().float().item())
        loss.backward(*args, **kwargs)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_a_backward_override_runs_handed_the_scaled_loss_and_trains_bit_for_bit(tmp_path, precision):
    # 37j #3 refused it (the plugin never called it); 37m: an override that only logs and calls
    # loss.backward() was refused too. Now the plugin calls it as Lightning's MixedPrecision does,
    # with the scaled loss, and the weights are those of the same module without the override
    plain, own = Digits(), LoggedBackward()
    fit(plain, AmpGuardPlugin(precision), steps=4)
    plugin = AmpGuardPlugin(precision, csv=tmp_path / "steps.csv")
    fit(own, plugin, steps=4)
    assert same(list(own.parameters()), list(plain.parameters()))
    scale = 65536.0 if precision == "16-mixed" else 1.0
    assert own.handed == [pytest.approx(float(r.loss) * scale, rel=1e-2) for r in plugin.records]
    if precision != "32-true":  # Lightning's own plugin hands its override the same (scaled) loss
        lightning = LoggedBackward()
        fit(lightning, MixedPrecision(precision, "cpu"), steps=4, gradient_clip_val=1.0)
        assert lightning.handed == pytest.approx(own.handed, rel=1e-6)


def test_a_second_fit_of_one_plugin_reads_its_own_modules_backward_override():
    # whether the module overrides backward is read once a fit (is_overridden cost ~19 us a backward):
    # a plugin's second fit, of a module that overrides it after one that did not, still calls it
    plugin = AmpGuardPlugin("bf16-mixed")
    fit(Digits(), plugin, steps=2)
    own = LoggedBackward()
    fit(own, plugin, steps=3)
    assert len(own.handed) == 3


def test_an_overrides_non_finite_loss_seeds_no_backward_and_the_step_is_skipped():
    # the check travels in the handed loss's graph: its backward seeds 0 for a NaN loss
    module, plugin = LoggedBackward(faults=["nan_loss@2"]), AmpGuardPlugin("16-mixed")
    fit(module, plugin, steps=3)
    assert [(r.step, r.reason) for r in plugin.records] == [(1, None), (2, "non_finite_loss"), (3, None)]
    assert same(module.after[2], module.after[1]) and all(torch.isfinite(p).all() for p in module.parameters())


class SkipsNonFinite(Digits):
    def backward(self, loss, *args, **kwargs):  # (a guard of one's own: no backward of a NaN loss)
        if torch.isfinite(loss):
            loss.backward(*args, **kwargs)


def test_an_override_that_leaves_out_a_non_finite_losss_backward_skips_that_step():
    # review 38d: refused as "ran no backward" at the NaN loss the guard exists to skip (Lightning's own
    # plugin trains on); the guard runs that backward itself, seeded 0: its own skip, bit for bit
    module, plugin = SkipsNonFinite(faults=["nan_loss@2"]), AmpGuardPlugin("bf16-mixed")
    fit(module, plugin, steps=3)
    plain = Digits(faults=["nan_loss@2"])
    fit(plain, AmpGuardPlugin("bf16-mixed"), steps=3)
    assert [(r.step, r.reason) for r in plugin.records] == [(1, None), (2, "non_finite_loss"), (3, None)]
    assert same(list(module.parameters()), list(plain.parameters()))


class NoBackward(Digits):
    def backward(self, loss, *args, **kwargs):
        loss.detach().requires_grad_().backward()  # (a copy: nothing reaches the model)


def test_an_override_that_runs_no_backward_through_its_loss_is_named(tmp_path):
    module = NoBackward()
    with pytest.raises(RuntimeError, match=r"^Guard\.backward\(\): the loop's backward \(NoBackward\.backward\) returned "
                                           r"without a backward through the loss it was handed"):
        fit(module, AmpGuardPlugin("bf16-mixed", csv=tmp_path / "steps.csv"), steps=2)
    assert same(list(module.parameters()), module.after[0]) and not (tmp_path / "steps.csv").exists()


def test_manual_backwards_arguments_reach_the_backward(tmp_path):
    # 37j: "manual_backward(loss) takes no arguments"; retain_graph=True (a second loss over the graph) is common
    class Manual(Digits):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            loss = Digits.training_step(self, batch, batch_idx)
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss, retain_graph=True)
            opt.step()
            self.kept = loss.grad_fn is not None and loss.grad_fn.next_functions  # (the graph still there)

    guarded, lightning = Manual(), Manual()
    fit(guarded, AmpGuardPlugin("bf16-mixed", max_norm=None), steps=3)
    fit(lightning, MixedPrecision("bf16-mixed", "cpu"), steps=3)
    assert same(list(guarded.parameters()), list(lightning.parameters()))
    assert not same(list(guarded.parameters()), guarded.after[0])


def test_arguments_that_failed_after_the_first_update_are_refused_up_front(tmp_path):
    # 37j #4: each was taken and failed at the first record (a bare AttributeError, deque's "maxlen must be
    # non-negative" naming no argument), after the first update
    with pytest.raises(TypeError, match=r"^AmpGuardPlugin\(sinks=\.\.\.\): 'steps.jsonl' is not a list of sinks; "
                                        r"give ampguard sinks, e\.g\. \[JsonlSink\('steps.jsonl'\)\]"):
        AmpGuardPlugin(sinks="steps.jsonl")
    with pytest.raises(TypeError, match=r"^AmpGuardPlugin\(sinks=\.\.\.\): None is not an ampguard sink"):
        AmpGuardPlugin(sinks=[None])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^AmpGuardPlugin\(keep_records={bad!r}\): a whole number >= 0"):
            AmpGuardPlugin(keep_records=bad)
    with pytest.raises(TypeError, match=r"^AmpGuardPlugin\(csv=123\): give the CSV's path"):
        AmpGuardPlugin(csv=123)
    with pytest.raises(TypeError, match=r"^AmpGuardPlugin\(log='no'\): True or False"):
        AmpGuardPlugin(log="no")
    assert AmpGuardPlugin(sinks=(s for s in [JsonlSink(tmp_path / "a.jsonl")]), keep_records=0).records.maxlen == 0
    plugin = AmpGuardPlugin("bf16-mixed")
    plugin.extra_sinks = ["steps.jsonl"]  # (how a later fit is given its sinks)
    module = Digits()
    with pytest.raises(TypeError, match=r"^plugin\.extra_sinks: 'steps.jsonl' is not an ampguard sink"):
        fit(module, plugin, steps=2)
    assert same(list(module.parameters()), module.after[0])


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a folder no file can be made in)")
def test_a_csv_that_cannot_be_written_is_refused_before_any_update():
    # 37j #4: csv="/proc/steps.csv" passed the folder checks and failed at the first record, the parameters changed
    module = Digits()
    with pytest.raises(InputError, match=r"^AmpGuardPlugin csv='/proc/ampguard-steps.csv': (no file can be made in "
                                         r"/proc \(.*\)|/proc is not a folder this user may write in); "
                                         r"give a csv path in a folder you can write$"):
        fit(module, AmpGuardPlugin("bf16-mixed", csv="/proc/ampguard-steps.csv"), steps=2)
    assert module.trainer.global_step == 0 and same(list(module.parameters()), module.after[0])
    assert not os.path.exists("/proc/ampguard-steps.csv")


def test_an_optimizer_step_that_skips_the_step_is_refused_not_taken_for_an_ended_epoch(tmp_path):
    # review 37m: the group drop fired for an optimizer_step override that steps every other batch,
    # warning of an ended epoch once a step; it is refused as before the drop existed
    class EveryOther(Digits):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx % 2 == 1:
                optimizer.step(closure=optimizer_closure)
            else:
                optimizer_closure()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="two backward"):
            fit(EveryOther(hidden=8), AmpGuardPlugin("bf16-mixed"), steps=4)
    assert not [w for w in caught if "the epoch ended" in str(w.message)]


def test_a_resumes_csv_is_checked_where_the_resume_rewrites_it(tmp_path):
    # review 37m: a resume cuts the CSV by writing a new file beside it and renaming it over the old:
    # its folder must be writable (a writable CSV in a read-only folder passed the check, then failed
    # after an update; a read-only CSV in a writable folder was refused, though the resume works)
    from ampguard.integrations.lightning import _check_writable

    with pytest.raises(InputError, match=r"(no file can be made in /proc \(.*\)|/proc is not a folder this user may "
                                         r"write in), where a resume rewrites the CSV"):
        _check_writable(Path("/proc/version"), "csv", rewritten=True)
    frozen = tmp_path / "steps.csv"
    frozen.write_text("step\n")
    frozen.chmod(0o444)
    if os.geteuid() == 0:  # (root writes a read-only file)
        _check_writable(frozen, "csv", rewritten=True)  # (its folder takes the rewritten file)
    else:  # review 39c: the rewritten file keeps the old one's mode (files.replace_atomically), so a read-only
        # CSV stays read-only and the resume could not append to it: refused before the fit trains
        with pytest.raises(InputError, match=r"^csv: cannot write .*: Permission denied \(a resume appends to it\)"):
            _check_writable(frozen, "csv", rewritten=True)


def test_keep_records_none_keeps_them_all_and_extra_sinks_are_checked_first():
    assert AmpGuardPlugin(keep_records=None).records.maxlen is None
    plugin = AmpGuardPlugin("32-true")
    plugin.extra_sinks = None  # (a bare TypeError from the closed-sinks check came first)
    with pytest.raises(TypeError, match=r"^plugin\.extra_sinks: None is not a list of sinks"):
        fit(Digits(hidden=8), plugin, steps=1)


def test_an_optimizer_step_skipped_at_an_epochs_last_batch_is_refused_too():
    # review 37q: at the epoch's last batch the skip looked like an epoch cut short: dropped and warned,
    # the guard's steps falling behind Lightning's global_step
    class SkipLast(Digits):
        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
            if batch_idx == self.trainer.num_training_batches - 1:
                optimizer_closure()
            else:
                optimizer.step(closure=optimizer_closure)

    with pytest.raises(RuntimeError, match="two backward"):
        fit(SkipLast(hidden=8), AmpGuardPlugin("bf16-mixed"), steps=20, data=loader(n=160))


def test_a_checkpoints_state_the_guard_refuses_is_one_line_naming_the_checkpoint(tmp_path):
    # review 47h: a resume under another window= raised the guard's bare "Guard.load_state_dict(): ..." line
    first = AmpGuardPlugin("bf16-mixed", window=16)
    trainer = fit(Digits(), first, steps=4)
    trainer.save_checkpoint(tmp_path / "at4.ckpt")
    with pytest.raises(ValueError, match=r"^AmpGuardPlugin: the ampguard state at4\.ckpt holds cannot be restored: "
                                         r".*skip_window.* \(the plugin's settings, window= and scaler= among them, "
                                         r"must be the run's\)$"):
        fit(Digits(), AmpGuardPlugin("bf16-mixed", window=32), steps=8, ckpt_path=tmp_path / "at4.ckpt")


# ---------------------------------------------------------------------------- review_51d


def test_a_fast_dev_run_writes_no_csv_and_the_real_fit_after_it_trains(tmp_path):
    # Lightning's smoke test writes no logs nor checkpoints; the plugin's CSV it wrote refused the
    # real fit that followed ("steps.csv already exists")
    csv = tmp_path / "steps.csv"
    with pytest.warns(AmpguardWarning, match=r"fast_dev_run: csv=.* not written"):
        fit(Digits(), AmpGuardPlugin("bf16-mixed", csv=csv), steps=3, fast_dev_run=True)
    assert not csv.exists()
    fit(Digits(), AmpGuardPlugin("bf16-mixed", csv=csv), steps=2)
    assert [r["step"] for r in rows(csv)] == ["1", "2"]


def test_a_flag_that_is_not_a_bool_and_an_empty_csv_are_refused_up_front():
    # "false", a non-empty string, turned the scale-collapse failure on; csv="" became ".", and the
    # fit was refused about csv='.', a path never given
    with pytest.raises(TypeError, match=r"fail_on_scale_collapse must be True or False, got 'false'"):
        AmpGuardPlugin("16-mixed", fail_on_scale_collapse="false")
    with pytest.raises(ValueError, match=r"AmpGuardPlugin\(csv=''\): give the path of the CSV file"):
        AmpGuardPlugin("bf16-mixed", csv="")


def test_a_fast_dev_run_serves_no_sinks_and_the_real_fit_takes_them(tmp_path):
    # review_51l: the sinks were written and closed by the smoke test: the real fit was refused
    # ("steps.jsonl already exists", or the same plugin's "sinks were closed")
    sink_path = tmp_path / "steps.jsonl"
    plugin = AmpGuardPlugin("bf16-mixed", sinks=[JsonlSink(sink_path)])
    with pytest.warns(AmpguardWarning, match=r"fast_dev_run: the sinks not written"):
        fit(Digits(), plugin, steps=3, fast_dev_run=True)
    assert not sink_path.exists() or sink_path.read_text() == ""
    fit(Digits(), plugin, steps=2)
    assert len(sink_path.read_text().splitlines()) == 2
