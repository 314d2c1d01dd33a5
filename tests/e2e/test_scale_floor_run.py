"""The loss scale never decays to 0: 200 NaN losses in fp16, then clean data, through ``ampguard
train`` (the defect: every clean step after them was skipped as inf x 0, final scale 0, exit 0)."""

from __future__ import annotations

import pytest

from helpers import ag, read_rows


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


@pytest.mark.parametrize("fail_after", [5])
def test_skipping_at_the_floor_fails_the_run_when_asked(tmp_path, monkeypatch, fail_after):
    monkeypatch.chdir(tmp_path)
    code, out, err = ag("train", "--set", "task.name=linear", "--set", "precision=fp16", "--set", "steps=100",
                        "--set", "eval.enabled=false", "--set", "log.name=c", "--set", "scaler.init_scale=4",
                        "--set", "monitor.fail_on_scale_collapse=true", "--fail-after", fail_after,
                        "--inject", "nan_loss@every:1")
    assert code == 3, out + err
    # 4 -> 2 -> 1 (the floor) at step 2; skipping at the floor from step 2: 5 in a row at step 6
    assert "stopped by the guard at step 6" in out
