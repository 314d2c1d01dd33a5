"""The fast path of ``ampguard train`` (config ``fast``), run on the CPU with ``fast: true``: the
sync-free step (fused optimizer, LR on the device, no host read decides a step) and the records
read back behind the step (``records.InFlight``).

On a CPU a record's values land at once, so the lag never shows by itself; the tests that are
about the lag hold every copy "in flight" (``Prefetch.landed`` answers False), so the loop runs
exactly ``LAG`` steps behind, as it can on a GPU. Expected steps come from the fault schedule.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import HostReads, ag, read_events, read_rows, reference_fail_step, reference_rates, train

import ampguard.records
from ampguard.config import validate
from ampguard.faults import parse_fault
from ampguard.records import LAG
from ampguard.run_folder import RunPaths
from ampguard.trainer import Trainer

LINEAR = ("--set", "task.name=linear", "--set", "log.every=1000", "--set", "device=cpu",
          "--set", "log.plot=false")  # (no plot read here)


@pytest.fixture
def lagging(monkeypatch):
    """Every record's copy stays "in flight" until the loop must wait for it (LAG steps on)."""
    monkeypatch.setattr(ampguard.records.Prefetch, "landed", lambda self: False)


def _run(tmp_path: Path, name: str, *args: str) -> tuple[int, str, str, Path]:
    code, out, err = train(tmp_path, name, *LINEAR, *args)
    return code, out, err, tmp_path / name


def _close(a: str, b: str, rel: float) -> bool:
    x, y = float(a), float(b)
    return (math.isnan(x) and math.isnan(y)) or x == y or abs(x - y) <= rel * max(abs(x), abs(y))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fast_run_makes_the_exact_runs_decisions(tmp_path, precision):
    """The same skips, reasons, scales and LR schedule (held on skips) as the exact path; the loss
    curve agrees to float rounding (fused vs foreach AdamW are not bit for bit)."""
    faults = ("--inject", "nan_loss@7", "--inject", "inf_grad@12")
    common = ("--set", f"precision={precision}", "--set", "steps=24", "--set", "schedule.warmup=5",
              "--set", "checkpoint.enabled=false", *faults)
    runs = {}
    for fast in ("true", "false"):
        code, out, err, run = _run(tmp_path, f"fast-{fast}", *common, "--set", f"fast={fast}")
        assert code == 0, err
        runs[fast] = (read_rows(run / "steps.csv"), read_events(run / "events.jsonl"))
    (fast_rows, fast_events), (exact_rows, exact_events) = runs["true"], runs["false"]
    assert [r["step"] for r in fast_rows] == [str(s) for s in range(1, 25)]
    for a, b in zip(fast_rows, exact_rows):
        assert (a["skipped"], a["skip_reason"], a["scaler_scale"]) == (b["skipped"], b["skip_reason"], b["scaler_scale"])
        assert _close(a["lr"], b["lr"], 1e-6), (a["step"], a["lr"], b["lr"])
        assert _close(a["loss"], b["loss"], 1e-3), (a["step"], a["loss"], b["loss"])
    assert [r["skip_reason"] for r in fast_rows if r["skipped"] == "1"] == ["non_finite_loss", "non_finite_grad"]
    # the LR holds on a skip: step 8 runs with step 7's LR (update 6 of the warm-up still to come)
    assert fast_rows[7]["lr"] == fast_rows[6]["lr"]
    # each skipped step's per-parameter gradient norms, named as on the exact path
    norms = {e["step"]: e for e in fast_events if e["event"] == "grad_norms"}
    exact_norms = {e["step"]: e for e in exact_events if e["event"] == "grad_norms"}
    assert sorted(norms) == sorted(exact_norms) == [7, 12]
    assert list(norms[12]["norms"]) == list(exact_norms[12]["norms"])
    assert norms[12]["non_finite"] == exact_norms[12]["non_finite"] != []
    start = [e for e in fast_events if e["event"] == "run_start"][0]["message"]
    assert "fast path" in start
    assert "exact path (fast: false)" in [e for e in exact_events if e["event"] == "run_start"][0]["message"]


def test_the_fast_step_reads_nothing_on_the_host(tmp_path):
    config = validate({"task": {"name": "linear"}, "steps": 6, "precision": "bf16", "device": "cpu", "fast": True,
                       "log": {"dir": str(tmp_path), "name": "a"}})
    trainer = Trainer(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=1, stats_every=None,
                      print_fn=lambda line: None, progress=False, resume=None)
    trainer._open()
    with trainer.watching():  # the first step learns backward's order (diagnose.grad_norms)
        trainer.train_step()
    for _ in range(3):
        with HostReads() as reads, trainer.watching():
            record = trainer.train_step()
        assert reads.count == 0, reads.names
        assert isinstance(record.loss, torch.Tensor)
    trainer.sinks.close()
    trainer.events.close()


def test_a_lagging_loop_stops_at_the_trigger_step_and_writes_every_step_taken(tmp_path, lagging):
    fault = parse_fault("inf_grad@rate:0.5", seed=0)
    window, fail_rate, fail_after, steps = 10, 0.2, 5, 80
    skipped = [fault.hits(s) for s in range(1, steps + 1)]
    expected = reference_fail_step(reference_rates(skipped, window), fail_rate, fail_after)
    assert expected is not None and expected + LAG < steps
    code, out, err, run = _run(tmp_path, "ff", "--set", "precision=fp32", "--set", f"steps={steps}",
                               "--set", "fast=true", "--inject", "inf_grad@rate:0.5", "--set", f"monitor.window={window}",
                               "--fail-skip-rate", str(fail_rate), "--fail-after", str(fail_after))
    assert code == 3, err
    # the guard names the step that tripped it, though the loop was LAG steps on
    assert [line for line in out.splitlines() if line.startswith("FAIL ")][0].startswith(f"FAIL {expected} ")
    events = read_events(run / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "fail"] == [expected]
    # every step the model took is in the CSV, with its own skip flag; the checkpoint is of the last
    rows = read_rows(run / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, expected + LAG + 1))
    assert [r["skipped"] == "1" for r in rows] == skipped[:expected + LAG]
    assert events[-1]["event"] == "run_end" and events[-1]["step"] == expected + LAG
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == [f"step-{expected + LAG:08d}.pt"]
    assert f"stopped by the guard at step {expected}" in (run / "RUN.md").read_text(encoding="utf-8")


def test_a_lagging_loop_names_each_skip_at_its_own_step(tmp_path, lagging):
    code, out, err, run = _run(tmp_path, "lag", "--set", "precision=bf16", "--set", "steps=12", "--set", "fast=true",
                               "--set", "log.every=1", "--inject", "nan_loss@4", "--inject", "inf_grad@9",
                               "--set", "eval.every=5")
    assert code == 0, err
    rows = read_rows(run / "steps.csv")
    assert [r["step"] for r in rows if r["skipped"] == "1"] == ["4", "9"]
    assert [r["step"] for r in rows if r["val_loss"]] == ["5", "10", "12"]  # evaluated at its own step
    skips = [line.split()[:2] for line in out.splitlines() if line.startswith("SKIP")]
    assert skips == [["SKIP", "4"], ["SKIP", "9"]]
    norms = [e for e in read_events(run / "events.jsonl") if e["event"] == "grad_norms"]
    assert [e["step"] for e in norms] == [4, 9]


def test_an_interrupt_mid_step_leaves_every_finished_step_in_the_csv(tmp_path, lagging, monkeypatch):
    original = Trainer.train_step

    def train_step(self):
        if self.state.steps == 6:  # a second Ctrl-C inside step 7: steps 5 and 6 are still in flight
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    code, out, err, run = _run(tmp_path, "int", "--set", "steps=20", "--set", "fast=true")
    assert code == 130, err
    assert [r["step"] for r in read_rows(run / "steps.csv")] == [str(s) for s in range(1, 7)]
    # "after step N" names the last step the CSV holds, not the last one read back before the interrupt
    assert [e["message"] for e in read_events(run / "events.jsonl") if e["event"] == "run_end"] == [
        "interrupted (Ctrl-C) after step 6"]


def test_a_second_ctrl_c_while_a_record_is_waited_for_leaves_no_gap(tmp_path, lagging, monkeypatch):
    # On a GPU the loop spends its time waiting for the LAG-old record's copy: a second Ctrl-C lands
    # there. The record waited for stays in flight, and the run's last drain writes it.
    original, fired = ampguard.records.Prefetch.__call__, []

    def call(self):
        if not fired and getattr(getattr(self._wait, "__self__", None), "step", None) == 5:
            fired.append(5)
            raise KeyboardInterrupt
        return original(self)

    monkeypatch.setattr(ampguard.records.Prefetch, "__call__", call)
    code, out, err, run = _run(tmp_path, "wait", "--set", "steps=20", "--set", "fast=true")
    assert code == 130 and fired == [5], err
    steps = [int(r["step"]) for r in read_rows(run / "steps.csv")]
    assert steps == list(range(1, 5 + LAG + 1))  # 5 waited for when step 5 + LAG was made
    ends = [e["message"] for e in read_events(run / "events.jsonl") if e["event"] == "run_end"]
    assert ends == [f"interrupted (Ctrl-C) after step {steps[-1]}"]


@pytest.mark.parametrize("fast", ["true", "false"])
def test_a_second_ctrl_c_while_a_record_is_written_finishes_that_record(tmp_path, lagging, monkeypatch, fast):
    # Both signals arrive inside the CSV write of step 5 (the first asks for a stop; the second would
    # interrupt at once): the row is written whole, then the run is interrupted, with no gap after it.
    import os
    import signal

    import ampguard.sinks
    original = ampguard.sinks.CsvSink.write

    def write(self, record, extra=None):
        if record.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, record, extra)

    monkeypatch.setattr(ampguard.sinks.CsvSink, "write", write)
    code, out, err, run = _run(tmp_path, "write", "--set", "steps=20", "--set", f"fast={fast}")
    assert code == 130, err
    steps = [int(r["step"]) for r in read_rows(run / "steps.csv")]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 5
    assert steps[-1] == (5 + LAG if fast == "true" else 5)  # the steps trained: all written


@pytest.mark.parametrize("setting", ["diagnose.strict=true", "monitor.headroom.every=5", "scheduler_on_skip=step"])
def test_fast_true_refuses_what_needs_the_exact_path(tmp_path, setting):
    code, out, err, run = _run(tmp_path, "refused", "--set", "fast=true", "--set", setting)
    assert code == 2
    assert err.count("\n") == 1 and "fast: true cannot serve" in err and "set fast: false" in err
    assert not run.exists()


def test_resume_switches_paths_and_records_it(tmp_path):
    # warm-up over all 10 steps: the LR moves every step. A fast-path checkpoint's groups hold the
    # last step's LR; the exact path's first resumed step took it as it was (step 6 at step 5's LR)
    code, _, err, run = _run(tmp_path, "r", "--set", "steps=10", "--set", "fast=true", "--set", "schedule.warmup=10",
                             "--inject", "inf_grad@3", "--set", "checkpoint.every=5")
    assert code == 0, err
    straight = read_rows(run / "steps.csv")
    (run / "checkpoints" / "step-00000010.pt").unlink()  # resume from step 5 on the exact path
    code, out, err = train(tmp_path, "r", *LINEAR, "--resume", str(run), "--set", "steps=10", "--set", "fast=false",
                           "--set", "schedule.warmup=10", "--inject", "inf_grad@3", "--set", "checkpoint.every=5")
    assert code == 0, err
    resumed = read_rows(run / "steps.csv")
    assert [r["step"] for r in resumed] == [str(s) for s in range(1, 11)]
    for a, b in zip(straight, resumed):  # the schedule goes on from the applied updates the checkpoint counted
        assert _close(a["lr"], b["lr"], 1e-6), (a["step"], a["lr"], b["lr"])
    policy = [e for e in read_events(run / "events.jsonl") if e["event"] == "policy_change"]
    assert [(e["old"], e["new"]) for e in policy if e["key"] == "fast"] == [(True, False)]


def test_a_rollback_to_a_fast_path_checkpoint_runs_its_next_step_at_the_schedules_lr(tmp_path):
    # resumed on the exact path with a rollback trigger, the run rolls back at step 8 to step-4,
    # written on the fast path: its groups held step 4's LR, and step 9 ran at it (0.0012, not 0.0015)
    common = ("--set", "steps=10", "--set", "schedule.warmup=10", "--set", "checkpoint.every=4",
              "--set", "precision=fp32", "--set", "max_norm=0", "--set", "optimizer.name=sgd",
              "--set", "monitor.window=4")
    code, _, err, run = _run(tmp_path, "f", *common, "--set", "fast=true")
    assert code == 0, err
    for step in (8, 10):
        (run / "checkpoints" / f"step-{step:08d}.pt").unlink()
    code, out, err = train(tmp_path, "f", *LINEAR, "--resume", str(run), *common, "--set", "fast=false",
                           "--set", "rollback.triggers=[skip_guard]", "--set", "rollback.skip_batches=1",
                           "--set", "monitor.fail_rate=0.3", "--set", "monitor.fail_after=2", "--inject", "nan_loss@6,7")
    assert code == 0, err
    [rollback] = [e for e in read_events(run / "events.jsonl") if e["event"] == "rollback"]
    assert (rollback["step"], rollback["checkpoint"]) == (8, "step-00000004.pt"), rollback
    rows = {int(r["step"]): r for r in read_rows(run / "steps.csv")}
    assert _close(rows[9]["lr"], rows[5]["lr"], 1e-6), (rows[5]["lr"], rows[9]["lr"])  # both the 5th update's


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_an_exact_run_resumes_on_the_fast_path(tmp_path, precision):
    # the exact run's checkpoint saves fused=None; loaded as it was, the fast step handed its
    # found_inf to the unfused AdamW, which raised "Expected grad_scale and found_inf to be None"
    code, _, err, run = _run(tmp_path, "x", "--set", f"precision={precision}", "--set", "steps=8",
                             "--set", "fast=false", "--set", "checkpoint.every=4", "--inject", "inf_grad@6")
    assert code == 0, err
    code, out, err = train(tmp_path, "x", *LINEAR, "--resume", str(run), "--set", "steps=12", "--set", "fast=true",
                           "--set", f"precision={precision}", "--inject", "inf_grad@10")
    assert code == 0, err
    rows = read_rows(run / "steps.csv")
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 13)]
    assert {int(r["step"]) for r in rows if r["skipped"] == "1"} == {6, 10}  # skipped on both paths


def test_tokens_per_second_and_mfu_on_the_stats_lines_and_the_run_card(tmp_path):
    """A tiny charlm on the CPU against a made-up peak of 1 GFLOP/s: the STATS lines and the run
    card carry tokens/s and the MFU that the task's FLOPs per token and that peak give."""
    code, out, err, run = _run(
        tmp_path, "mfu", "--set", "task.name=charlm", "--set", "task.n_layer=1", "--set", "task.n_embd=16",
        "--set", "task.n_head=2", "--set", "task.block_size=16", "--set", "task.batch_size=4", "--set", "steps=4",
        "--set", "log.every=2", "--set", "log.peak_tflops=0.001", "--set", "eval.enabled=false")
    assert code == 0, err
    stats = [line for line in out.splitlines() if line.startswith("STATS ")]
    assert len(stats) == 2
    for line in stats:
        fields = dict(word.split("=", 1) for word in line.split()[2:] if "=" in word)
        tokens, mfu = float(fields["tokens/s"].replace(",", "")), float(fields["mfu"].rstrip("%")) / 100
        from ampguard.tasks.charlm import CharLM, flops_per_token
        flops = flops_per_token(CharLM(16, 1, 2, 16), 1, 16, 16)
        assert mfu == pytest.approx(tokens * flops / 1e9, rel=0.02, abs=0.001)
    card = (run / "RUN.md").read_text(encoding="utf-8")
    row = [line for line in card.splitlines() if line.startswith("| throughput")][0]
    assert "tokens/s, MFU" in row and "from the end of the first step" in row
    assert "| step path | exact path |" in card


def test_the_gpt2_small_preset_sizes_the_model(tmp_path):
    from ampguard.config import validate
    from ampguard.tasks import build_task

    config = validate({"task": {"preset": "gpt2-small", "batch_size": 1}, "eval": {"batches": 1}})
    with torch.device("meta"):  # (the shapes and counts without drawing 86M initial weights: ~1 s of CPU)
        task = build_task(config)
    assert len(task.model.blocks) == 12 and task.model.tok.weight.shape[1] == 768 and task.model.pos.weight.shape[0] == 1024
    assert 84e6 < sum(p.numel() for p in task.model.parameters()) < 87e6
    code, out, err, run = _run(tmp_path, "clash", "--set", "task.name=charlm", "--set", "task.preset=gpt2-small",
                               "--set", "task.n_layer=4")
    assert code == 2 and "preset gpt2-small sets n_layer=12" in err and "drop n_layer=4" in err and not run.exists()


def test_a_fast_checkpoint_resumed_on_the_exact_path_steps_at_the_exact_paths_lrs(tmp_path):
    # review_51i F4: the fast checkpoint's float32 tensor LRs were filled in place on the exact path,
    # whose every later LR (and steps.csv's) then read float32-rounded: 0.0016499999910593033 for 0.00165
    run = ("--set", "task.name=linear", "--set", "log.plot=false", "--set", "eval.enabled=false", "--set", "steps=12",
           "--set", "schedule.warmup=3", "--set", "schedule.decay=linear", "--set", "checkpoint.every=5",
           "--inject", "nan_loss@2,5,6")
    assert train(tmp_path, "exact", *run, "--set", "fast=false")[0] == 0
    assert train(tmp_path, "fast", *run, "--set", "fast=true")[0] == 0
    code, out, err = ag("train", "--resume", tmp_path / "fast" / "checkpoints" / "step-00000005.pt", "--set", "fast=false")
    assert code == 0, err
    exact = [r["lr"] for r in read_rows(tmp_path / "exact" / "steps.csv")]
    resumed = [r["lr"] for r in read_rows(tmp_path / "fast" / "steps.csv")]
    assert resumed[5:] == exact[5:] and "0.0016500000000000002" in exact
