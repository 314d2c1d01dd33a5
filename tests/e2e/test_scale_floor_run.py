"""The loss scale never decays to 0: 200 NaN losses in fp16, then clean data, through ``ampguard
train`` (the defect: every clean step after them was skipped as inf x 0, final scale 0, exit 0)."""

from __future__ import annotations

import pytest

from helpers import ag, read_rows, run_events

from ampguard.errors import ExitCode


def test_200_nan_losses_then_clean_data_train_again_from_the_floor(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = ",".join(str(s) for s in range(1, 201))
    code, out, err = ag("train", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=230",
                        "--set", "eval.enabled=false", "--set", "log.name=f", "--set", "log.every=1000",
                        "--inject", f"nan_loss@{bad}")
    assert code == 0, out + err
    rows = read_rows(tmp_path / "runs" / "f" / "steps.csv")
    scales = [float(r["scaler_scale"]) for r in rows]
    assert min(scales) == 1.0  # scaler.min_scale: the floor, never 0 or a subnormal
    assert scales[15] == 1.0  # 2**16 halved 16 times: at the floor from step 16 on
    assert all(r["skip_reason"] == "non_finite_loss" for r in rows[:200])
    assert all(r["skipped"] == "0" for r in rows[200:])  # clean data is trained on again
    assert "summary: steps=230 updates=30 skips=200 (non_finite_loss=200) final_scale=1" in out


@pytest.mark.parametrize("fail_after", [1, 5])
def test_skipping_at_the_floor_fails_the_run_when_asked(tmp_path, monkeypatch, fail_after):
    monkeypatch.chdir(tmp_path)
    code, out, err = ag("train", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=100",
                        "--set", "eval.enabled=false", "--set", "log.name=c", "--set", "scaler.init_scale=4",
                        "--set", "monitor.fail_on_scale_collapse=true", "--fail-after", fail_after,
                        "--inject", "nan_loss@every:1")
    assert code == ExitCode.GUARD == 3, out + err
    # 4 -> 2 at step 1, -> 1 (the floor) at step 2; skipping at the floor from step 2 on:
    # fail_after in a row at step 1 + fail_after
    stop = 1 + fail_after
    assert f"stopped by the guard at step {stop}: loss scale at its floor" in out
    rows = read_rows(tmp_path / "runs" / "c" / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(1, stop + 1))
    assert [float(r["scaler_scale"]) for r in rows] == [2.0] + [1.0] * fail_after
    assert all(r["skipped"] == "1" and r["skip_reason"] == "non_finite_loss" for r in rows)
    fails = [e for e in run_events(tmp_path / "runs" / "c") if e["event"] == "fail"]
    # the scale-collapse guard stopped it, not the skip-rate one (whose fail_rate may change default)
    assert [(e["step"], e["cause"], e["scale"], e["min_scale"]) for e in fails] == [
        (stop, "scale_collapse", 1.0, 1.0)]
