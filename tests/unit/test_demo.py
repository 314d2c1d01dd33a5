"""The teaching demo (``ampguard.demo``): its config, its refusal of an existing CSV, one
console line per step."""

from __future__ import annotations

import csv

import pytest

from ampguard import demo
from ampguard.errors import ExitCode, InputError
from ampguard.sinks import CSV_COLUMNS


def test_the_defaults_are_the_documented_demo():
    c = demo.demo_config()
    assert c.task.name == "linear" and c.task.batch_size == 32
    assert c.precision == "fp16"
    assert c.inject == ["inf_grad@5"]
    assert c.steps == 20 and c.max_norm == 1.0
    assert c.scaler.init_scale == 1024 == demo.INIT_SCALE
    assert c.scaler.growth_interval == 1_000_000  # the scale never grows during the demo
    assert (c.optimizer.name, c.optimizer.lr, c.optimizer.momentum) == ("sgd", 0.2, 0.0)
    assert (c.schedule.warmup, c.schedule.decay, c.scheduler_on_skip) == (10, "constant", "hold") == (
        demo.WARMUP, "constant", "hold")
    assert not c.eval.enabled and not c.diagnose.strict


def test_the_arguments_reach_the_config():
    c = demo.demo_config(precision="bf16", steps=7, inject=[], max_norm=0.5, seed=3, device="cpu", strict=True,
                         monitor={"fail_rate": 0.5, "fail_after": 2})
    assert (c.precision, c.steps, c.inject, c.max_norm, c.seed, c.device) == ("bf16", 7, [], 0.5, 3, "cpu")
    assert c.diagnose.strict and (c.monitor.fail_rate, c.monitor.fail_after) == (0.5, 2)
    assert c.task.name == "linear" and c.scaler.init_scale == 1024  # the rest stays the demo's


def test_an_existing_csv_is_refused_and_nothing_is_written(tmp_path, capsys):
    existing = tmp_path / "steps.csv"
    existing.write_text("someone's rows\n")
    with pytest.raises(InputError) as err:
        demo.run(demo.demo_config(precision="bf16", steps=2, device="cpu"), csv=str(existing))
    assert str(err.value) == f"--csv {existing} already exists; refusing to overwrite it"
    assert existing.read_text() == "someone's rows\n"
    assert [p.name for p in tmp_path.iterdir()] == ["steps.csv"]
    assert capsys.readouterr().out == ""  # refused before the set-up line


def step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("STEP ", "SKIP "))]


def test_a_six_step_bf16_demo_prints_one_line_per_step(tmp_path, capsys):
    csv_path = tmp_path / "steps.csv"
    code = demo.run(demo.demo_config(precision="bf16", steps=6, device="cpu", inject=["inf_grad@5"]), csv=str(csv_path))
    out = capsys.readouterr().out
    assert code == ExitCode.OK == 0
    assert out.splitlines()[0] == ("ampguard demo: nn.Linear, 6 steps, bf16 with no loss scaler, max_norm=1.0, "
                                   "inject: inf_grad@5")
    lines = step_lines(out)
    assert [" ".join(line.split()[:2]) for line in lines] == ["STEP 1", "STEP 2", "STEP 3", "STEP 4", "SKIP 5",
                                                              "STEP 6"]
    assert lines[4].endswith("reason=non_finite_grad") and " pre=inf " in lines[4]
    assert "summary: steps=6 updates=5 skips=1 (non_finite_grad=1)" in out
    assert f"csv: {csv_path} (6 rows)" in out
    with csv_path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == CSV_COLUMNS and [r[0] for r in rows[1:]] == ["1", "2", "3", "4", "5", "6"]
    assert [r[5] for r in rows[1:]] == ["0", "0", "0", "0", "1", "0"]


def test_without_a_csv_the_demo_writes_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = demo.run(demo.demo_config(precision="bf16", steps=3, device="cpu", inject=[]))
    out = capsys.readouterr().out
    assert code == ExitCode.OK
    assert [line.split()[0] for line in step_lines(out)] == ["STEP"] * 3
    assert "inject: none" in out.splitlines()[0]
    assert list(tmp_path.iterdir()) == []


def test_the_default_demo_holds_the_warming_lr_at_its_skip(tmp_path, capsys):
    # The contract: step 5 is the only SKIP and the scale halves exactly there. The warm-up makes
    # "the LR schedule holds on a skipped step" visible: step 6 runs at step 5's lr.
    csv_path = tmp_path / "steps.csv"
    assert demo.run(demo.demo_config(device="cpu"), csv=str(csv_path)) == ExitCode.OK
    lines = step_lines(capsys.readouterr().out)
    assert [line.split()[0] for line in lines] == ["STEP"] * 4 + ["SKIP"] + ["STEP"] * 15
    assert [int(line.split()[1]) for line in lines] == list(range(1, 21))
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    scales = [float(r["scaler_scale"]) for r in rows]
    assert scales == [demo.INIT_SCALE] * 4 + [demo.INIT_SCALE / 2] * 16
    lrs = [float(r["lr"]) for r in rows]
    assert [float(line.split("lr=")[1].split()[0]) for line in lines] == pytest.approx(lrs, rel=1e-3)
    # step k runs at LR * (u + 1) / WARMUP, u the updates applied before it (the skip applied none)
    applied = [sum(r["skipped"] == "0" for r in rows[:k]) for k in range(20)]
    assert lrs == pytest.approx([demo.LR * min(1.0, (u + 1) / demo.WARMUP) for u in applied])
    assert lrs[5] == lrs[4] == pytest.approx(0.1)  # held: the step after the skip, at the skip's lr
    rises = [later > earlier for earlier, later in zip(lrs, lrs[1:])]
    assert rises[:10] == [True] * 4 + [False] + [True] * 5  # it rises everywhere else in the warm-up
    assert lrs[10:] == pytest.approx([demo.LR] * 10)  # then constant
