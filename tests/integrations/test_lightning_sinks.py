"""AmpGuardPlugin's sinks and its stop, in real Lightning Trainers on the CPU: the tracker sinks
(MLflow's file store, W&B offline) get the monitor's view of every step with the step and end
with the fit's outcome; a guard's failure stops a Trainer that has ``min_steps`` /
``min_epochs``; the sinks given to the plugin serve one fit.

The workload is an 8-input MLP on 64 random rows, 8 a batch (8 steps an epoch); the loss is
made NaN, or an exception raised, from inside ``training_step``.
"""

from __future__ import annotations

import glob
import signal
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

L = pytest.importorskip("lightning")
wandb = pytest.importorskip("wandb")
pytest.importorskip("mlflow")

from test_trackers import wandb_run  # noqa: E402 - the offline W&B run-file reader

from ampguard.integrations.lightning import AmpGuardPlugin  # noqa: E402
from ampguard.integrations.trackers import MLflowSink, WandbSink  # noqa: E402
from ampguard.sinks import JsonlSink  # noqa: E402


class Tiny(L.LightningModule):
    """``nan_at``: the optimizer steps (from 1) whose loss is NaN; ``raise_at``: ``(step,
    exception)``, raised by that step's ``training_step``."""

    def __init__(self, nan_at=(), raise_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
        self.nan_at, self.raise_at = set(nan_at), raise_at

    def training_step(self, batch, batch_idx):
        step = self.trainer.global_step + 1
        if self.raise_at is not None and step == self.raise_at[0]:
            raise self.raise_at[1]
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss * float("nan") if step in self.nan_at else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    return torch.utils.data.DataLoader(data, batch_size=8)


def fit(plugin, steps, module, **trainer_args):
    settings = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_checkpointing=False, enable_model_summary=False)
    trainer = L.Trainer(plugins=[plugin], **{**settings, **trainer_args})
    trainer.fit(module, loader())
    return trainer


# every loss NaN from step 2: the rate is above 0.5 from step 3 (2/3), for the second step at step 4
DIVERGED = dict(fail_rate=0.5, fail_after=2, min_steps=0)
NAN_FROM_2 = range(2, 100)


def mlflow_sink(tmp_path):
    return MLflowSink(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="pl")


def history(sink, key):
    return {m.step: m.value for m in sink.client.get_metric_history(sink.run_id, key)}


def test_an_mlflow_run_gets_the_monitors_view_of_each_step_with_the_step(tmp_path):
    """Each step's row goes out with the monitor's view (monitor/*) by the end of its batch, not
    at the next step; the ALERT sets the tags; a fit that returns ends the run FINISHED."""
    sink, held = mlflow_sink(tmp_path), []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            held.append(max(history(sink, "monitor/skip_rate"), default=None))

    plugin = AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False, min_steps=0)
    fit(plugin, 3, Tiny(nan_at={2}), callbacks=[Watch()])
    assert held == [1, 2, 3]
    assert history(sink, "monitor/skip_rate") == {1: 0.0, 2: 0.5, 3: pytest.approx(1 / 3)}
    assert history(sink, "monitor/skip_rate_alert") == {1: 0.0, 2: 1.0, 3: 1.0}
    assert history(sink, "train/skip.non_finite_loss") == {1: 0.0, 2: 1.0, 3: 0.0}
    run = sink.client.get_run(sink.run_id)
    assert run.data.tags["ampguard.events.skip_rate_alert"] == "2"
    assert run.data.tags["ampguard.last_alert"].startswith("step 2: rolling skip rate 0.500")
    assert run.info.status == "FINISHED" and run.data.tags["ampguard.exit_code"] == "0"
    assert run.data.tags["ampguard.ended"] == "finished: 3 steps" and run.data.metrics["summary/skips"] == 1.0


@pytest.mark.parametrize("outcome, status, code", [
    ("crash", "FAILED", "1"), ("guard stop", "FAILED", "3"), ("ctrl-c", "KILLED", "130")])
def test_the_tracker_run_ends_with_the_fits_outcome(tmp_path, outcome, status, code):
    """As ``ampguard train`` ends it: a crash is FAILED (exit 1), a guard's stop FAILED (3),
    Ctrl-C KILLED (130; Lightning then exits 1); the steps taken are all logged."""
    sink = mlflow_sink(tmp_path)
    plugin = AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False, **DIVERGED)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        if outcome == "crash":
            with pytest.raises(RuntimeError, match="boom"):
                fit(plugin, 10, Tiny(raise_at=(3, RuntimeError("boom"))))
        elif outcome == "guard stop":
            fit(plugin, 10, Tiny(nan_at=NAN_FROM_2))
        else:
            with pytest.raises(SystemExit):  # Lightning's graceful shutdown after a KeyboardInterrupt
                fit(plugin, 10, Tiny(raise_at=(3, KeyboardInterrupt())))
    finally:
        signal.signal(signal.SIGINT, sigint)  # (Lightning ignores SIGINT from a KeyboardInterrupt on)
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == status and run.data.tags["ampguard.exit_code"] == code
    taken = [1, 2, 3, 4] if outcome == "guard stop" else [1, 2]
    assert sorted(history(sink, "train/skipped")) == sorted(history(sink, "monitor/skip_rate")) == taken
    ended = run.data.tags["ampguard.ended"]
    if outcome == "crash":
        assert ended == "crashed: RuntimeError: boom"
    elif outcome == "guard stop":
        assert ended == plugin.stop_reason and run.data.tags["ampguard.events.fail"] == "4"
        assert run.data.tags["ampguard.last_alert"].startswith("step 4: rolling skip rate above fail_rate 0.5")
    else:
        assert ended == "interrupted (Ctrl-C)"


def test_a_fit_a_callback_stopped_early_says_so_and_ends_finished(tmp_path):
    # EarlyStopping's trainer.should_stop ended the fit at step 2 of 10: its run said "finished: 2 steps"
    class StopAt2(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step == 2

    for max_steps, ended in ((10, "stopped after step 2: a callback asked (trainer.should_stop, e.g. EarlyStopping)"),
                             (2, "finished: 2 steps")):  # (asked at the fit's last step: it stopped nothing)
        sink = mlflow_sink(tmp_path)
        trainer = fit(AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False), max_steps, Tiny(), callbacks=[StopAt2()])
        run = sink.client.get_run(sink.run_id)
        assert trainer.global_step == 2 and run.info.status == "FINISHED" and run.data.tags["ampguard.ended"] == ended


def test_a_wandb_offline_run_stopped_by_the_guard_holds_the_monitor_and_exits_3(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # a W&B set up earlier in this process keeps its settings
    sink = WandbSink(project="pl", mode="offline", dir=tmp_path)
    plugin = AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False, **DIVERGED)
    fit(plugin, 10, Tiny(nan_at=NAN_FROM_2))
    wandb.teardown()  # W&B's service completes the run file
    (logged,) = [wandb_run(Path(p)) for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))]
    assert sorted(logged.history) == [1, 2, 3, 4]
    assert [logged.history[s]["monitor/skip_rate"] for s in (1, 2, 3, 4)] == [0.0, 0.5, pytest.approx(2 / 3), 0.75]
    assert logged.exit_code == 3 and logged.summary["exit_code"] == 3 and logged.summary["events.fail"] == 1
    assert logged.summary["last_alert"].startswith("step 4: rolling skip rate above fail_rate 0.5")


class Normed(Tiny):
    """Tiny with a BatchNorm on its raw input: under bf16 autocast on the CPU its output stays
    float32 (its input's dtype), the Linear layers after it compute in bfloat16."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def test_the_layers_autocast_left_in_float32_are_named_on_the_plugin_and_in_the_tracker_run(tmp_path):
    """``ampguard train``'s card and GuardedTrainer name them; a Lightning fit did not. The fit's
    first training step notes each leaf module's output dtype (hooks for that step only), and
    the tracker run's summary gets the card's line; an fp32 fit notes nothing."""
    sink, module = mlflow_sink(tmp_path), Normed(nan_at={1})  # (a skipped first step is still a forward)
    plugin = AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False)
    fit(plugin, 3, module)
    assert plugin.autocast_dtypes == {"net.0": "float32", "net.1": "bfloat16", "net.2": "bfloat16", "net.3": "bfloat16"}
    assert not any(m._forward_hooks for m in module.modules())  # gone after the first step
    assert plugin.state_dict()["autocast_dtypes"] == plugin.autocast_dtypes  # a record kept with a checkpoint
    tags = sink.client.get_run(sink.run_id).data.tags
    assert tags["ampguard.float32_under_autocast"] == "net.0 (1 of 4 layers; the others bfloat16)"
    plugin = AmpGuardPlugin("32-true", sinks=[mlflow_sink(tmp_path)], log=False)
    fit(plugin, 1, module)
    assert plugin.autocast_dtypes is None
    assert "ampguard.float32_under_autocast" not in plugin.extra_sinks[0].client.get_run(
        plugin.extra_sinks[0].run_id).data.tags


def test_a_first_step_that_runs_out_of_memory_leaves_the_map_to_the_retry():
    """BatchSizeFinder retries a smaller batch after an out-of-memory in the fit: the failed first
    step had noted one layer, and the map stayed that (a four-layer model's card line "net.0 (1
    of 1 layer)"). A step that raises notes nothing; the retry notes the map."""
    class Finding(Normed):
        batch_size = 8

        def train_dataloader(self):
            return loader().__class__(loader().dataset, batch_size=self.batch_size)

        def training_step(self, batch, batch_idx):
            x, y = batch
            hidden = self.net[0](x)
            if x.shape[0] > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
            return F.cross_entropy(self.net[3](self.net[2](self.net[1](hidden))), y)

    from lightning.pytorch.callbacks import BatchSizeFinder

    plugin, module = AmpGuardPlugin("bf16-mixed", log=False), Finding()
    settings = dict(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_checkpointing=False, enable_model_summary=False)
    L.Trainer(plugins=[plugin], callbacks=[BatchSizeFinder(mode="power", init_val=8, steps_per_trial=1)],
              **settings).fit(module)
    assert module.batch_size == 4
    assert plugin.autocast_dtypes == {"net.0": "float32", "net.1": "bfloat16", "net.2": "bfloat16", "net.3": "bfloat16"}


def test_a_compiled_model_is_not_hooked_for_the_float32_map():
    """Hooks traced into a compiled forward, then removed after the first step, made dynamo
    compile it a second time: a model compiled inside the LightningModule (or the module itself,
    ``trainer.fit(torch.compile(module))``) is left alone, its map empty, compiled once."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    module = Normed()
    module.net = torch.compile(module.net, backend=counting)
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    fit(plugin, 3, module)
    assert plugin.autocast_dtypes == {} and len(graphs) == 1
    plugin = AmpGuardPlugin("bf16-mixed", log=False)
    fit(plugin, 1, torch.compile(Normed(), backend="eager"))
    assert plugin.autocast_dtypes == {}


class NaNInput(Normed):
    """Normed whose third step reads a NaN batch (its BatchNorm's statistics NaN unless put back)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.trainer.global_step + 1 == 3:
            x = x * float("nan")
        return F.cross_entropy(self.net(x), y)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_skipped_steps_batchnorm_statistics_are_put_back_in_a_fit(compiled):
    # review 35c: a compiled module's layers' hooks copy nothing while dynamo traces, and the plugin
    # autocasts by itself, not through guard.autocast(): its statistics stayed NaN for good
    module = NaNInput()
    if compiled:
        module.net = torch.compile(module.net, backend="eager")
    plugin = AmpGuardPlugin("32-true", log=False)
    fit(plugin, 4, module)
    assert [r.skipped for r in plugin.records] == [False, False, True, False]
    bn = (module.net._orig_mod if compiled else module.net)[0]
    assert torch.isfinite(bn.running_mean).all() and int(bn.num_batches_tracked) == 3


class NoneThenNaN(Normed):
    """Normed whose second batch's training_step returns None (after its forward) and whose third is NaN."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        if batch_idx == 2:
            x = x * float("nan")
        loss = F.cross_entropy(self.net(x), y)
        return None if batch_idx == 1 else loss


def test_a_step_that_returned_none_keeps_its_statistics_when_the_next_is_skipped():
    # review 36a: the plugin counted the None step but kept the copy taken before it, so the
    # skip after it put back the statistics from before both: the None step's forward undone
    module = NoneThenNaN()
    plugin = AmpGuardPlugin("32-true", log=False)
    fit(plugin, 4, module)
    assert [r.skipped for r in plugin.records] == [False, True, False]
    bn = module.net[0]
    assert torch.isfinite(bn.running_mean).all() and int(bn.num_batches_tracked) == 3  # (Lightning's own: 3)


@pytest.mark.parametrize("minimum, set_aside", [
    ({"min_steps": 20}, "min_steps=20"), ({"min_epochs": 2}, "min_epochs=2"),
    ({"min_steps": 3}, "min_epochs=1, which Lightning sets for min_steps=3")])
def test_the_guards_failure_stops_a_trainer_that_has_min_steps_or_min_epochs(minimum, set_aside):
    """Lightning ignores ``should_stop`` until min_steps / min_epochs are met (16 steps for 2
    epochs here; min_steps=3 holds the first epoch too): the guard sets the unmet ones aside for
    the fit, which stops at the failing step, names them, and gives them back after."""
    plugin = AmpGuardPlugin("bf16-mixed", log=False, **DIVERGED)
    with pytest.warns(UserWarning, match="ampguard stopped the trainer at step 4"):
        trainer = fit(plugin, 40, Tiny(nan_at=NAN_FROM_2), **minimum)
    assert trainer.global_step == 4 and plugin.monitor.failed.step == 4
    assert [r.step for r in plugin.records] == [1, 2, 3, 4]
    assert plugin.stop_reason.startswith("ampguard stopped the trainer at step 4: rolling skip rate above")
    assert plugin.stop_reason.endswith(f" (set aside: the Trainer's {set_aside})")
    assert {k: getattr(trainer, k) for k in minimum} == minimum  # the Trainer's own settings back


def test_the_sinks_serve_one_fit_and_a_second_fit_is_refused_before_it_trains(tmp_path):
    """The plugin closes its sinks when a fit ends (a tracker run ends with it): a second fit
    with the same plugin is refused up front (it crashed on the closed sink after applying its
    first step); given new sinks it runs. A fit refused by the plugin's own checks closes none."""
    first = tmp_path / "first.jsonl"
    plugin, module = AmpGuardPlugin("bf16-mixed", sinks=[JsonlSink(first)], log=False), Tiny()
    with pytest.raises(ValueError, match="drop the Trainer's gradient_clip_val"):
        fit(plugin, 2, module, gradient_clip_val=1.0)
    fit(plugin, 2, module)
    assert len(first.read_text().splitlines()) == 2
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=r"sinks=\['JsonlSink'\] were closed when the previous fit with this "
                                         r"plugin ended .*new sinks \(plugin.extra_sinks = \[\.\.\.\]\)"):
        fit(plugin, 2, module)
    assert all(torch.equal(p, q) for p, q in zip(before, module.parameters(), strict=True))  # nothing trained
    assert len(first.read_text().splitlines()) == 2
    second = tmp_path / "second.jsonl"
    plugin.extra_sinks = [JsonlSink(second)]
    fit(plugin, 2, module)
    assert len(second.read_text().splitlines()) == 2


def test_a_crashed_fit_raises_its_own_error_when_a_sink_fails_to_close(tmp_path):
    class CloseFails(MLflowSink):
        def close(self):
            super().close()
            raise OSError("the sink cannot close")

    sink = CloseFails(tracking_uri=(tmp_path / "mlruns").as_uri(), experiment="pl")
    with pytest.raises(RuntimeError, match="boom") as raised:
        fit(AmpGuardPlugin("bf16-mixed", sinks=[sink], log=False), 10, Tiny(raise_at=(3, RuntimeError("boom"))))
    assert raised.value.__notes__ == ["ampguard: closing the plugin's sinks raised too: OSError('the sink cannot close')"]
    run = sink.client.get_run(sink.run_id)
    assert run.info.status == "FAILED" and run.data.tags["ampguard.exit_code"] == "1"
