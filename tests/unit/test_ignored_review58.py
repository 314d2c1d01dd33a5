"""Review 58a F3: settings a run takes and never reads were accepted without a word:
``fp32_modules`` under ``precision: fp32`` (no autocast: the names checked, nothing more), and a
rollback trigger's own settings when the triggers are set but not that one (``rollback.z`` and
``rollback.window`` without ``loss_spike``, ``rollback.val_*`` without ``val_regression``). Each
is now one ``ignored_settings`` line, as ``scaler.*`` without a scaler is; a setting left at its
default, or read by the run, is not."""

from __future__ import annotations

from ampguard.config import ignored_settings, validate

NO_SPIKE = "rollback.triggers has no loss_spike (no loss-spike detector)"
NO_VAL = "rollback.triggers has no val_regression (no held-out rollback)"
GUARD = {"checkpoint": {"every": 2}, "monitor": {"fail_rate": 0.5}}


def said(config: dict) -> list[str]:
    return ignored_settings(validate(config))


def test_fp32_modules_are_said_ignored_under_fp32_alone():
    assert said({"precision": "fp32", "fp32_modules": ["blocks.0.mlp"]}) == [
        "precision fp32 runs no autocast (every module computes in FP32 already): fp32_modules ignored"]
    for precision in ("bf16", "fp16"):  # (read: autocast keeps them in FP32)
        assert said({"precision": precision, "fp32_modules": ["blocks.0.mlp"]}) == []
    assert said({"precision": "fp32", "fp32_modules": []}) == []  # (the default: nothing given)


def test_the_loss_spike_settings_are_said_ignored_without_that_trigger():
    guard = {**GUARD, "rollback": {"triggers": ["skip_guard"], "z": 3.0, "window": 5}}
    assert said(guard) == [f"{NO_SPIKE}: rollback.z, rollback.window ignored"]
    assert ignored_settings(validate(guard), only=["rollback.window"]) == [f"{NO_SPIKE}: rollback.window ignored"]
    assert said({**GUARD, "rollback": {"triggers": ["skip_guard"], "z": 6.0, "window": 50}}) == []  # (defaults)
    assert said({**GUARD, "rollback": {"triggers": ["skip_guard", "loss_spike"], "z": 3.0, "window": 5}}) == []


def test_the_val_regression_settings_are_said_ignored_without_that_trigger():
    val = {"val_regression": 0.5, "val_metric": "val_loss", "val_mode": "min"}
    assert said({**GUARD, "rollback": {"triggers": ["loss_spike"], **val}}) == [
        f"{NO_VAL}: rollback.val_regression, rollback.val_metric, rollback.val_mode ignored"]
    assert said({**GUARD, "rollback": {"triggers": ["skip_guard"], "z": 3.0, "val_metric": "val_f1"}}) == [
        f"{NO_SPIKE}: rollback.z ignored", f"{NO_VAL}: rollback.val_metric ignored"]
    assert said({**GUARD, "eval": {"every": 2}, "rollback": {"triggers": ["val_regression"], **val}}) == []
    assert said({**GUARD, "rollback": {"triggers": ["loss_spike"], "val_mode": "auto"}}) == []  # (the default)
    # rollback.* with no trigger at all has its own line: not said again per trigger
    assert said({"rollback": {"z": 3.0, "val_mode": "min"}}) == [
        "rollback.triggers is empty (no rollback): rollback.z, rollback.val_mode ignored"]
