"""A rollback keeps the evidence (issue item 11): the batches that triggered it saved as
``rollback/step-N.pt`` and loadable by ``locate --batch``; the run card's "updates applied" equal
to the checkpoint's counter; ``rollback.lr_factor``; a ``val_regression`` trigger on the run's
own evaluation; and the triggering batch skipped even when ``skip_batches`` is smaller than the
gap back to the checkpoint. Tiny runs, CPU.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from helpers import ag, card_table, ok, one_error_line, read_rows, run_events, train

from ampguard import checkpoint as ckpt

LINEAR = ["--set", "task.name=linear", "--set", "device=cpu"]

POISONED_FACTORY = '''
import torch
from torch import nn

BAD = {bad}  # micro-batch indices whose targets are multiplied by 1e4


def build(config):
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(123)
    w = torch.randn(8, 1, generator=gen)
    data = []
    for i in range(200):
        x = torch.randn(16, 8, generator=gen)
        data.append((x, x @ w * (1e4 if i in BAD else 1.0)))
    return {{"model": nn.Linear(8, 1), "data": data, "loss_fn": nn.functional.mse_loss}}
'''


def _factory(tmp_path: Path, bad: set[int]) -> tuple[list[str], Path]:
    path = tmp_path / "poisoned.py"
    path.write_text(POISONED_FACTORY.format(bad=sorted(bad)), encoding="utf-8")
    return ["--set", f"task.factory={path}:build", "--set", "precision=fp32", "--set", "optimizer.name=sgd",
            "--set", "optimizer.lr=0.05", "--set", "optimizer.momentum=0", "--set", "schedule.decay=constant",
            "--set", "checkpoint.keep=20"], path


def _card_value(run: Path, label: str) -> str:
    return card_table((run / "RUN.md").read_text(encoding="utf-8"))[label]


def _final(run: Path) -> dict:
    return ckpt.load_checkpoint(ckpt.list_checkpoints(run / "checkpoints")[-1])


def test_a_skip_guard_rollback_saves_the_skipped_batch_for_locate_and_counts_only_kept_updates(tmp_path):
    # fp16: targets x 1e8 at steps 6 and 7 overflow the backward, both skipped; the guard trips at 8
    code, out, err = train(tmp_path, "R", *LINEAR, "--set", "precision=fp16", "--set", "steps=10",
                           "--set", "checkpoint.every=4", "--set", "rollback.triggers=[skip_guard]",
                           "--set", "monitor.window=4", "--set", "monitor.fail_rate=0.3", "--set", "monitor.fail_after=2",
                           "--set", "rollback.skip_batches=1", "--inject", "spike@6,7")
    assert code == 0, out + err
    run = tmp_path / "R"
    [event] = [e for e in run_events(run) if e["event"] == "rollback"]
    assert event["step"] == 8 and event["checkpoint"] == "step-00000004.pt" and event["kind"] == "skip_guard"
    assert event["evidence"] == "rollback/step-8.pt"
    assert event["updates_undone"] == 2  # steps 5 and 8 were applied after the checkpoint, then undone

    saved = torch.load(run / "rollback" / "step-8.pt", weights_only=True)
    assert saved["step"] == 7 and saved["kind"] == "skip_guard"  # the last skipped step's batch
    assert saved["loss_scale"] == 2.0**15  # the scale step 7 ran with (backed off once at step 6)
    [micro] = saved["micro_batches"]
    assert micro["targets"].abs().max() > 1e6  # the spiked targets themselves

    # the card's "updates applied" is what the model holds: the final checkpoint's counter
    final = _final(run)
    assert final["updates"] == final["state"]["updates"] == 4 + 2  # steps 1-4, then 9 and 10
    assert _card_value(run, "updates applied") == str(final["updates"])
    assert "rollback/step-8.pt" in _card_value(run, "rollbacks")

    # locate --batch replays it (at the scale it ran with) and finds the overflow: exit 1
    code, out, err = ag("locate", run / "config.yaml", "--batch", run / "rollback" / "step-8.pt", "--json")
    assert code == 1, err
    found = json.loads(out)
    assert found["amp"]["where"] == "backward" and found["verdict"] == "precision-range"
    assert found["loss_scale"] == 2.0**15


def test_a_trigger_before_the_first_checkpoint_rolls_back_to_the_runs_start(tmp_path):
    # seed 001: keep a consistent checkpoint before trying. With rollbacks on, the run saves
    # step 0 before it trains: a guard that trips at step 3, before checkpoint.every's first
    # save at 5, rolls back there (it stopped the run, exit 3, "cannot roll back")
    args = [*LINEAR, "--set", "precision=bf16", "--set", "steps=10", "--set", "checkpoint.every=5",
            "--set", "rollback.triggers=[skip_guard]", "--set", "monitor.fail_rate=0.5", "--set", "monitor.fail_after=3",
            "--inject", "nan_loss@1,2,3"]
    ok(train(tmp_path, "R", *args))
    run = tmp_path / "R"
    [event] = [e for e in run_events(run) if e["event"] == "rollback"]
    assert event["step"] == 3 and event["checkpoint"] == "step-00000000.pt"
    start = ckpt.load_checkpoint(run / "checkpoints" / "step-00000000.pt")
    assert start["step"] == 0 and start["updates"] == 0
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [
        "step-00000000.pt", "step-00000005.pt", "step-00000010.pt"]
    rows = read_rows(run / "steps.csv")
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 11)] and _final(run)["updates"] == 7
    # a run killed before its first checkpoint.every resumes from the start, bit for bit
    (run / "checkpoints" / "step-00000005.pt").unlink()
    (run / "checkpoints" / "step-00000010.pt").unlink()
    before, start_file = (run / "steps.csv").read_bytes(), (run / "checkpoints" / "step-00000000.pt").read_bytes()
    ok(ag("train", "--resume", run))
    assert (run / "steps.csv").read_bytes() == before
    assert (run / "checkpoints" / "step-00000000.pt").read_bytes() == start_file  # what it resumed from: not rewritten
    # without rollbacks nothing is saved before step 1
    ok(train(tmp_path, "plain", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2"))
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "plain" / "checkpoints")] == [
        "step-00000002.pt", "step-00000004.pt"]


def _poisoned_batch(factory: Path, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("poisoned_for_test", factory)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(SimpleNamespace(seed=0))["data"][index]


def test_a_skip_smaller_than_the_checkpoint_gap_still_skips_the_spiking_batch(tmp_path):
    # checkpoint at step 30 (data position 30); batch 34 (step 35) spikes; skip_batches 2 would go
    # back to position 32 and train on batch 34 again, spiking again until rollback.max is spent
    args, factory = _factory(tmp_path, {34})
    out = ok(train(tmp_path, "R", *args, "--set", "checkpoint.every=10", "--set", "rollback.triggers=[loss_spike]",
                   "--set", "rollback.window=20", "--set", "rollback.skip_batches=2", "--set", "rollback.lr_factor=0.5",
                   "--set", "steps=45"))
    run = tmp_path / "R"
    rollbacks = [e for e in run_events(run) if e["event"] == "rollback"]
    assert len(rollbacks) == 1, out
    assert rollbacks[0]["step"] == 35 and "goes on at position 35, 5 batches past the checkpoint (at 30)" in rollbacks[0]["message"]
    assert _final(run)["data_position"] == 35 + 10  # steps 36-45 on batches 35-44
    # the spike window restarts after a rollback, so a replayed batch 34 would not even be judged:
    # it would be trained on (its loss ~2e8 at step 38); it never comes back
    losses = {int(r["step"]): float(r["loss"]) for r in read_rows(run / "steps.csv")}
    assert losses[35] > 1e6 and all(losses[s] < 10 for s in range(36, 46))
    # a second pass over step 35 (a resume from step 30's checkpoint, rollback.max raised) keeps the
    # first pass's evidence: it goes to step-35-2.pt (review_tests14 #2)
    first = (run / "rollback" / "step-35.pt").read_bytes()
    ok(ag("train", "--resume", run / "checkpoints" / "step-00000030.pt", "--set", "rollback.max=3"))
    again = [e for e in run_events(run) if e["event"] == "rollback"][-1]
    assert again["step"] == 35 and again["evidence"] == "rollback/step-35-2.pt"
    assert (run / "rollback" / "step-35.pt").read_bytes() == first
    assert again["evidence_checkpoint"] == "rollback/step-35-2.checkpoint.pt" and (run / again["evidence_checkpoint"]).is_file()

    # the evidence is batch 34 itself
    saved = torch.load(run / "rollback" / "step-35.pt", weights_only=True)
    x, y = _poisoned_batch(factory, 34)
    assert saved["step"] == 35 and saved["kind"] == "loss_spike"
    assert torch.equal(saved["micro_batches"][0]["inputs"], x) and torch.equal(saved["micro_batches"][0]["targets"], y)

    # rollback.lr_factor 0.5: the (constant) LR halves from the first step after the rollback
    lrs = {int(r["step"]): float(r["lr"]) for r in read_rows(run / "steps.csv")}
    assert {lrs[s] for s in range(1, 36)} == {0.05}
    assert {lrs[s] for s in range(36, 46)} == {0.025}
    assert "lr 0.025 (rollback.lr_factor 0.5)" in rollbacks[0]["message"]


def test_a_held_out_regression_rolls_back_to_the_checkpoint_of_the_last_good_evaluation(tmp_path):
    # no clipping, targets x 1e8 at step 7: the update wrecks the model; the evaluation at 8 sees it
    out = ok(train(tmp_path, "R", *LINEAR, "--set", "precision=fp32", "--set", "steps=12", "--set", "max_norm=0",
                   "--set", "optimizer.name=sgd", "--set", "optimizer.lr=0.01", "--set", "checkpoint.every=2",
                   "--set", "eval.every=2", "--set", "rollback.triggers=[val_regression]",
                   "--set", "rollback.skip_batches=1", "--inject", "spike@7"))
    run = tmp_path / "R"
    [event] = [e for e in run_events(run) if e["event"] == "rollback"]
    assert event["kind"] == "val_regression" and event["step"] == 8
    assert event["checkpoint"] == "step-00000006.pt"  # the evaluation at 6 was fine
    assert "held-out regression at step 8 (val_loss" in event["message"]
    assert event["evidence"] is None and not (run / "rollback").exists()  # no training batch to keep
    rows = {int(r["step"]): r for r in read_rows(run / "steps.csv")}
    assert float(rows[12]["val_loss"]) < 2 * float(rows[6]["val_loss"]), out  # trained on, back to normal


def test_a_second_rollback_never_goes_back_into_the_steps_the_first_undid(tmp_path):
    # the spike at 12 wrecks the model, saved at 15; ROLLBACK 16 goes to 10. The second rollback
    # (first bad step 18) took the newest checkpoint before 18: step-15, the wrecked model the
    # first had undone, and the run ended "finished" with a val_loss of 2e12. The undone steps'
    # checkpoints are set aside at a rollback: the second goes to step 10 too
    ok(train(tmp_path, "R", *LINEAR, "--set", "precision=fp32", "--set", "max_norm=0", "--set", "optimizer.name=sgd",
             "--set", "optimizer.lr=0.01", "--set", "steps=26", "--set", "checkpoint.every=5",
             "--set", "checkpoint.keep=50", "--set", "rollback.triggers=[skip_guard]", "--set", "monitor.window=4",
             "--set", "monitor.fail_rate=0.3", "--set", "monitor.fail_after=3", "--set", "rollback.skip_batches=1",
             "--set", "eval.every=1", "--inject", "spike@12", "--inject", "nan_loss@13,14,18,19"))
    run = tmp_path / "R"
    rollbacks = [e for e in run_events(run) if e["event"] == "rollback"]
    # (review 54k: the window the first rollback restarted counts step 18's skip over min(min_steps, window)
    # 4 steps, 0.25, not 1 of 2: the guard trips at 21, not 20)
    assert [(e["step"], e["checkpoint"]) for e in rollbacks] == [(16, "step-00000010.pt"), (21, "step-00000010.pt")]
    assert "the undone steps' step-00000015.pt set aside (checkpoints/abandoned-*)" in rollbacks[0]["message"]
    # (the second rollback, at 21 since review 54k, set aside the step-20 checkpoint it undid too)
    assert "the undone steps' step-00000020.pt set aside" in rollbacks[1]["message"]
    folders = {tuple(p.name for p in folder.iterdir()): folder for folder in (run / "checkpoints").glob("abandoned-*")}
    assert sorted(folders) == [("step-00000015.pt",), ("step-00000020.pt",)]
    abandoned = folders[("step-00000015.pt",)]
    rows = {int(r["step"]): r for r in read_rows(run / "steps.csv")}
    assert float(rows[26]["val_loss"]) < 2 * float(rows[10]["val_loss"])  # trained on from the good model
    assert 15 not in [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(run / "checkpoints")]  # (--resume RUN_DIR)
    # asked for by name, the set-aside checkpoint is refused saying why (its run folder was taken to
    # be checkpoints/: "has no steps.csv to continue"; taken as it is, steps.csv mixed two timelines)
    line = one_error_line(ag("train", "--resume", abandoned / "step-00000015.pt", "--set", "steps=30"))
    assert line.endswith(f"step-00000015.pt was set aside (checkpoints/{abandoned.name}/): a resume or a rollback "
                         "went on from an older checkpoint, and the run's steps.csv and checkpoints hold that timeline "
                         "from there; it cannot be resumed in this run folder"), line


def test_a_rollback_at_the_last_step_leaves_the_kept_models_loss_and_metrics_as_the_runs_final(tmp_path):
    # the run card, report and compare said final_loss=9.3e15 (the spike undone at step 9) and a
    # held-out val_loss of 2e10 (the evaluation that triggered the rollback), with the model of step 8 kept
    ok(train(tmp_path, "S", *LINEAR, "--set", "precision=bf16", "--set", "steps=9", "--set", "checkpoint.every=2",
             "--set", "rollback.triggers=[loss_spike]", "--set", "rollback.window=3", "--set", "rollback.skip_batches=1",
             "--inject", "spike@9"))
    ok(train(tmp_path, "V", *LINEAR, "--set", "precision=fp32", "--set", "max_norm=0", "--set", "optimizer.name=sgd",
             "--set", "optimizer.lr=0.01", "--set", "steps=11", "--set", "eval.every=4", "--set", "checkpoint.every=2",
             "--set", "rollback.triggers=[val_regression]", "--set", "rollback.skip_batches=1", "--inject", "spike@10"))
    for name, step in (("S", 9), ("V", 11)):
        assert [e["step"] for e in run_events(tmp_path / name) if e["event"] == "rollback"] == [step]
    rows = {name: {int(r["step"]): r for r in read_rows(tmp_path / name / "steps.csv")} for name in ("S", "V")}
    loss8 = {name: float(rows[name][8]["loss"]) for name in rows}
    assert float(rows["S"][9]["loss"]) > 1e12 and float(rows["V"][11]["val_loss"]) > 1e6  # (the undone step's)
    for name in ("S", "V"):
        card = card_table((tmp_path / name / "RUN.md").read_text(encoding="utf-8"))
        assert card["loss of applied steps"].split("final ")[1].startswith(f"{loss8[name]:.4g} (step 8"), card
        code, out, err = ag("report", tmp_path / name, "--no-plot")
        assert code == 0 and f"final_loss={loss8[name]:.6g} (step 8)" in out.splitlines()[0], (out, err)
    val8 = float(rows["V"][8]["val_loss"])
    assert _card_value(tmp_path / "V", "held-out val_loss") == f"final {val8:.4g}, best {val8:.4g}"
    code, out, err = ag("compare", tmp_path / "S", tmp_path / "V")
    assert code == 0, err
    [losses] = [line for line in out.splitlines() if line.startswith("| loss final / best")]
    assert [cell.split(" / ")[0].strip() for cell in losses.split("|")[2:4]] == [f"{loss8['S']:.4g}", f"{loss8['V']:.4g}"]
    [held] = [line for line in out.splitlines() if line.startswith("| val_loss final / best")]
    assert held.split("|")[3].split(" / ")[0].strip() == f"{val8:.4g}"


def test_a_skip_guard_rollback_after_a_resume_saves_no_clean_batch_as_its_evidence(tmp_path):
    # the skipped steps (22, 23) ran before the resume: the process had no skipped batch, and the
    # evidence saved was the triggering step's own, an applied batch with nothing wrong in it
    args = [*LINEAR, "--set", "precision=bf16", "--set", "checkpoint.every=3", "--set", "rollback.triggers=[skip_guard]",
            "--set", "monitor.window=4", "--set", "monitor.fail_rate=0.3", "--set", "monitor.fail_after=2",
            "--set", "rollback.skip_batches=1", "--set", "steps=30", "--set", "rollback.max=2",
            "--inject", "nan_loss@6,7,14,15,22,23"]
    code, out, err = train(tmp_path, "R", *args)
    assert code == 3 and "rollback.max" in out + err, (out, err)  # (used up at 24)
    ok(ag("train", "--resume", tmp_path / "R", "--set", "rollback.max=3"))
    resumed = [e for e in run_events(tmp_path / "R") if e["event"] == "rollback"][-1]
    rows = {int(r["step"]): r for r in read_rows(tmp_path / "R" / "steps.csv")}
    assert rows[resumed["step"]]["skipped"] == "0"  # (the trigger: an applied step)
    assert resumed["evidence"] is None and not (tmp_path / "R" / "rollback" / f"step-{resumed['step']}.pt").exists()
    assert resumed["message"].endswith("; no batch saved (the skipped steps ran before this process resumed the run)")


def test_bad_rollback_settings_are_one_line_and_write_nothing(tmp_path):
    args, _ = _factory(tmp_path, set())
    cases = [
        (LINEAR + ["--set", "rollback.lr_factor=2"], "rollback.lr_factor: must be in (0, 1]"),
        (LINEAR + ["--set", "rollback.val_regression=-0.1"], "rollback.val_regression: must be a finite number > 0"),
        (LINEAR + ["--set", "rollback.triggers=[val_regression]", "--set", "checkpoint.every=2",
                   "--set", "eval.every=0"], "val_regression needs the held-out evaluation"),
        (LINEAR + ["--set", "rollback.triggers=[val_regression]", "--set", "checkpoint.every=2",
                   "--set", "eval.every=2", "--set", "rollback.val_metric=val_f1"],
         "rollback.val_metric: the task reports val_loss, not 'val_f1'"),
        (args + ["--set", "rollback.triggers=[val_regression]", "--set", "checkpoint.every=2",
                 "--set", "eval.every=2"], "val_regression needs held-out metrics"),
    ]
    for i, (argv, message) in enumerate(cases):
        line = one_error_line(train(tmp_path / "runs", f"R{i}", *argv, "--set", "steps=4"))
        assert message in line, line
    assert not (tmp_path / "runs").exists()


IMPROVING_FACTORY = """
import torch
from torch import nn

def build(config):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 2, generator=g), torch.randn(8, 1, generator=g)) for _ in range(64)]
    calls = [0]

    def evaluate(model, held_out):
        calls[0] += 1
        return {NAME: 0.5 + 0.1 * calls[0]}  # better at every evaluation, if higher is better

    return {"model": nn.Linear(2, 1), "data": data, "loss_fn": nn.functional.mse_loss, "evaluate": evaluate,
            "metrics": [NAME]}
"""


def test_a_val_regression_watch_goes_the_way_its_metric_improves(tmp_path):
    """Every name without "acc" counted as a loss: an F1 improving at every evaluation rolled
    back three times and stopped the run (exit 3). F1 (AUC, BLEU, ...) now count as higher-is-
    better, a name that says nothing is refused until rollback.val_mode says, and val_mode
    decides when given."""
    args = ["--set", "precision=fp32", "--set", "steps=5", "--set", "eval.every=1", "--set", "checkpoint.every=1",
            "--set", "rollback.triggers=[val_regression]"]
    for name, extra, refused in (("val_f1", [], None),
                                 ("val_thing", [], "is val_thing better higher or lower? its name does not say"),
                                 ("val_thing", ["--set", "rollback.val_mode=max"], None)):
        factory = tmp_path / f"{name}.py"
        factory.write_text(IMPROVING_FACTORY.replace("NAME", repr(name)), encoding="utf-8")
        result = train(tmp_path, f"{name}-{len(extra)}", "--set", f"task.factory={factory}:build", *args, *extra)
        if refused:
            assert refused in one_error_line(result)
            continue
        ok(result)
        run = tmp_path / f"{name}-{len(extra)}"
        assert not [e for e in run_events(run) if e["event"] == "rollback"]
        assert f"best {0.5 + 0.1 * 5:g}" in (run / "RUN.md").read_text(encoding="utf-8")  # the highest is the best


def test_a_skip_guard_finds_its_checkpoint_though_keep_is_smaller_than_its_look_back(tmp_path):
    # review_walk14 B1/B2: checkpoint.every 5 x keep 3 kept 15 steps, the guard looks back 20: "cannot
    # roll back: no checkpoint from before step 59", exit 3; and the checkpoint a rollback returned
    # to was pruned later, so its evidence could not be replayed on the weights it ran on
    window = ",".join(str(s) for s in range(30, 71))
    # (100 steps: the saves after the rollback prune the checkpoint it returned to; the undone steps'
    # ones were set aside at the rollback)
    ok(train(tmp_path, "R", *LINEAR, "--set", "precision=bf16", "--set", "steps=100", "--set", "checkpoint.every=5",
             "--set", "rollback.triggers=[skip_guard]", "--set", "monitor.fail_rate=0.5",
             "--set", "monitor.fail_after=20", "--inject", f"nan_loss@{window}"))
    run = tmp_path / "R"
    rollbacks = [e for e in run_events(run) if e["event"] == "rollback"]
    assert rollbacks and rollbacks[0]["kind"] == "skip_guard"
    first = rollbacks[0]
    assert ckpt.checkpoint_step(Path(first["checkpoint"])) < first["step"] - 20 + 1
    kept = run / first["evidence_checkpoint"]
    assert kept.name == f"step-{first['step']}.checkpoint.pt" and not (run / "checkpoints" / first["checkpoint"]).exists()
    assert ckpt.load_checkpoint(kept)["step"] == ckpt.checkpoint_step(Path(first["checkpoint"]))
    code, out, err = ag("locate", run / "config.yaml", "--batch", run / first["evidence"], "--checkpoint", kept)
    assert code in (0, 1) and not err.strip(), err
    # no more than keep + the one a rollback may need are left
    assert len(ckpt.list_checkpoints(run / "checkpoints")) <= 20 // 5 + 2


def test_a_val_regression_finds_the_evaluation_before_though_keep_is_smaller_than_its_look_back(tmp_path):
    # the regression at the evaluation of step 40 returns to the one of step 20; with checkpoints
    # every 5 and keep 3 only 30-40 were left: "cannot roll back: no checkpoint from before step 21"
    ok(train(tmp_path, "R", "--set", "task.name=digits", "--set", "device=cpu", "--set", "precision=bf16",
             "--set", "steps=45", "--set", "optimizer.name=sgd", "--set", "optimizer.lr=0.1", "--set", "max_norm=0",
             "--set", "eval.every=20", "--set", "checkpoint.every=5", "--set", "rollback.triggers=[val_regression]",
             "--inject", "spike@25"))
    [event] = [e for e in run_events(tmp_path / "R") if e["event"] == "rollback"]
    assert event["step"] == 40 and event["kind"] == "val_regression" and event["checkpoint"] == "step-00000020.pt"


def test_the_evidence_of_an_accumulated_step_holds_its_whole_group(tmp_path):
    # accumulation 2: step 18 trains on batches 34 (spiked) and 35; the evidence must hold both, the
    # spiked one first, or `locate --batch` replays half a group and may miss the spike (review_tests14 #3)
    args, factory = _factory(tmp_path, {34})
    out = ok(train(tmp_path, "R", *args, "--set", "accumulation_steps=2", "--set", "checkpoint.every=5",
                   "--set", "rollback.triggers=[loss_spike]", "--set", "rollback.window=5", "--set", "steps=22"))
    [event] = [e for e in run_events(tmp_path / "R") if e["event"] == "rollback"]
    assert event["step"] == 18, out
    saved = torch.load(tmp_path / "R" / event["evidence"], weights_only=True)
    assert len(saved["micro_batches"]) == 2
    spiked, clean = _poisoned_batch(factory, 34), _poisoned_batch(factory, 35)
    assert torch.equal(saved["micro_batches"][0]["targets"], spiked[1])
    assert torch.equal(saved["micro_batches"][1]["targets"], clean[1])


def test_a_resume_removes_an_evidence_checkpoint_copy_a_kill_cut_short(tmp_path):
    # review_session14b #8: a `.step-N.checkpoint.pt.tmp-PID` a killed run left in rollback/ (as a hard
    # link it keeps a pruned checkpoint's disk) was never removed
    ok(train(tmp_path, "R", *LINEAR, "--set", "steps=4", "--set", "checkpoint.every=2"))
    run = tmp_path / "R"
    (run / "rollback").mkdir()
    leftover = run / "rollback" / ".step-3.checkpoint.pt.tmp-999999"
    leftover.write_bytes(b"half")
    kept = run / "rollback" / "step-3.pt"
    kept.write_bytes(b"evidence")
    ok(ag("train", "--resume", run, "--set", "steps=5"))
    assert not leftover.exists() and kept.read_bytes() == b"evidence"


def test_the_plotted_skip_rate_starts_its_window_again_at_a_rollback_as_the_run_did(tmp_path, monkeypatch):
    # review_28b: report's and compare's curve kept the skips that made the rollback in its window
    # (1.0, 0.75, 0.5 after it, over the fail_rate line) where the run judged 0 and cleared the ALERT
    import ampguard.compare
    import ampguard.report
    from ampguard.cli import main

    args = [*LINEAR, "--set", "precision=bf16", "--set", "steps=10", "--set", "checkpoint.every=4",
            "--set", "rollback.triggers=[skip_guard]", "--set", "monitor.window=4", "--set", "monitor.min_steps=2",
            "--set", "monitor.fail_rate=0.5", "--set", "monitor.fail_after=2", "--inject", "nan_loss@5,6,7"]
    ok(train(tmp_path, "R", *args))
    run = tmp_path / "R"
    [event] = [e for e in run_events(run) if e["event"] == "rollback"]
    assert event["step"] == 8
    ok(train(tmp_path, "plain", *LINEAR, "--set", "precision=bf16", "--set", "steps=10"))
    drawn = []
    real = ampguard.report.rolling_skip_rate

    def spy(rows, window, rollbacks=(), *rest):
        drawn.append(real(rows, window, rollbacks, *rest))
        return drawn[-1]

    monkeypatch.setattr(ampguard.report, "rolling_skip_rate", spy)
    monkeypatch.setattr(ampguard.compare, "rolling_skip_rate", spy)
    assert main(["report", str(run), "--out", str(tmp_path / "r.png")]) == 0
    assert main(["compare", str(run), str(tmp_path / "plain"), "--out", str(tmp_path / "c.png")]) == 0
    expected = [0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 0.75] + [0.0] * 2  # (emptied after step 8, as the monitor's)
    assert drawn[0] == drawn[1] == expected
