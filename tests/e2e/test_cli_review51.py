"""Review 51f: the command line and the config at their edges. A fail-fast rate of 1 was taken and
never tripped (a run skipping every step ended "finished", exit 0); torchrun's variables other
than WORLD_SIZE were tracebacks; ``--print-config`` printed a ``fast: true`` the run refused;
``demo`` resolved ``--spike`` beside ``--inject`` otherwise than ``train``; settings nothing reads
were silent; a dotted key in a file was "unknown"."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from helpers import ag, ok, one_error_line, train

LINEAR = ["--set", "task.name=linear", "--set", "log.plot=false"]


def test_a_fail_skip_rate_of_1_is_refused_and_a_configured_one_is_said(tmp_path):
    line = one_error_line(ag("train", *LINEAR, "--fail-skip-rate", "1", "--print-config"))
    assert line.startswith("ampguard: error: train: argument --fail-skip-rate: must be a rate in [0, 1), got 1: no "
                           "skip rate is above 1"), line
    ok(ag("train", *LINEAR, "--fail-skip-rate", "0.99", "--print-config"))  # (below 1: armed)
    # every step skipped, monitor.fail_rate 1 in the config: the run says the guard never trips
    code, out, err = train(tmp_path, "r", *LINEAR, "--set", "steps=3", "--set", "monitor.fail_rate=1",
                           "--inject", "nan_loss@1", "--inject", "nan_loss@2", "--inject", "nan_loss@3")
    assert code == 0 and "monitor.fail_rate 1: no skip rate is above 1, so the fail-fast never trips" in err, err


@pytest.mark.parametrize("given, said", [
    (["--set", "monitor.fail_after=5"], "monitor.fail_rate is not set and no scale-collapse guard runs "
                                        "(monitor.fail_on_scale_collapse with a loss scaler): nothing fails fast: "
                                        "monitor.fail_after ignored"),
    (["--set", "precision=bf16", "--set", "monitor.fail_on_scale_collapse=true"],
     "precision bf16 uses no loss scaler (no scale to collapse): monitor.fail_on_scale_collapse ignored"),
    (["--set", "optimizer.momentum=0.5"], "optimizer adamw has no momentum setting (SGD's): optimizer.momentum ignored"),
    (["--set", "optimizer.name=sgd", "--set", "optimizer.eps=1e-6"],
     "optimizer sgd has no betas or eps (AdamW's): optimizer.eps ignored"),
    (["--set", "schedule.decay=constant", "--set", "schedule.min_lr_ratio=0.5"],
     "schedule.decay is constant (no decay to a floor): schedule.min_lr_ratio ignored"),
    (["--set", "rollback.z=3"], "rollback.triggers is empty (no rollback): rollback.z ignored"),
    (["--set", "rollback.triggers=[skip_guard]", "--set", "monitor.fail_rate=0.5", "--set", "checkpoint.every=2",
      "--set", "rollback.window=5"],  # (review 58a: a trigger's own setting without it)
     "rollback.triggers has no loss_spike (no loss-spike detector): rollback.window ignored"),
    (["--set", "eval.enabled=false", "--set", "eval.every=5"], "eval.enabled is false: eval.every ignored"),
])
def test_a_setting_the_run_does_not_read_is_a_warning(given, said):
    code, out, err = ag("train", *LINEAR, *given, "--print-config")
    assert code == 0 and f"ampguard: warning: {said}" in err.splitlines(), err


@pytest.mark.parametrize("name, value, expected", [
    ("RANK", "abc", "RANK=abc with WORLD_SIZE=2: expected a whole number from 0 to 1"),
    ("RANK", "2", "RANK=2 with WORLD_SIZE=2: expected a whole number from 0 to 1"),
    ("LOCAL_RANK", "x", "LOCAL_RANK=x with WORLD_SIZE=2: expected a whole number >= 0"),
    ("MASTER_PORT", "99999", "MASTER_PORT=99999 with WORLD_SIZE=2: expected a whole number from 0 to 65535"),
])
@pytest.mark.parametrize("verb", ["train", "demo"])
def test_a_bad_torchrun_variable_is_one_line_exit_2(tmp_path, verb, name, value, expected):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
           name: value}
    argv = ["train", *LINEAR, "--set", f"log.dir={tmp_path}"] if verb == "train" else ["demo", "--device", "cpu"]
    with mock.patch.dict(os.environ, env):
        line = one_error_line(ag(*argv))
    assert line.startswith(f"ampguard: error: {expected} (torchrun sets it"), line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("setting", [["--set", "diagnose.strict=true"], ["--set", "optimizer.fused=false"],
                                     ["--set", "monitor.headroom.every=2"]])
def test_print_config_refuses_a_fast_path_the_run_cannot_take(setting):
    argv = ["train", *LINEAR, "--set", "fast=true", *setting]
    refused = one_error_line(ag(*argv, "--set", "steps=1", "--set", "log.dir=/nonexistent/for/sure"))
    assert refused.startswith("ampguard: error: fast: true "), refused
    assert one_error_line(ag(*argv, "--print-config")).startswith("ampguard: error: fast: true ")


def test_demo_takes_spike_beside_inject_as_train_does():
    assert one_error_line(ag("demo", "--inject", "none", "--spike", "--steps", "6", "--bf16", "--device", "cpu")) == (
        "ampguard: error: demo: --spike injects spike@5, --inject none nothing: give one of them")
    out = ok(ag("demo", "--spike", "--inject", "spike@5", "--steps", "6", "--bf16", "--device", "cpu"))
    assert "inject: spike@5" in out and out.count("spike@5") == 1, out


def test_a_dotted_or_empty_key_in_a_file_is_named_as_such(tmp_path):
    (tmp_path / "dotted.yaml").write_text("optimizer.lr: 0.1\n", encoding="utf-8")
    (tmp_path / "empty.yaml").write_text("optimizer:\n  '': 1\n", encoding="utf-8")
    assert one_error_line(ag("train", tmp_path / "dotted.yaml", "--print-config")) == (
        "ampguard: error: config: optimizer.lr: a key with a dot in it: nest it (optimizer: {lr: ...}) in a file; "
        "dotted keys are --set's spelling")
    assert one_error_line(ag("train", tmp_path / "empty.yaml", "--print-config")) == (
        "ampguard: error: config: optimizer: an empty key ('')")


def test_a_verb_for_one_process_under_torchrun_runs_on_rank_0_alone(tmp_path):
    # review_51g: every rank ran validate whole: with --out one rank refused the other's folder
    # (exit 2, the job failed for an ACCEPTED validation), without it two reports and two records
    out = tmp_path / "v"
    argv = ["validate", *LINEAR, "--set", "validation.precisions=[bf16]", "--set", "validation.max_mse=100",
            "--set", f"log.dir={tmp_path}", "--out", out]
    torchrun = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with mock.patch.dict(os.environ, {**torchrun, "RANK": "1"}):
        code, stdout, err = ag(*argv)
    assert code == 0 and err.splitlines() == [
        "ampguard: validate runs in one process: this is rank 1 of 2 (torchrun's RANK, WORLD_SIZE), rank 0 runs it"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with mock.patch.dict(os.environ, {**torchrun, "RANK": "0"}):
        code, stdout, err = ag(*argv)
    assert code in (0, 1) and (out / "validation.json").exists(), err
    # a RANK and WORLD_SIZE left in the environment alone are no torchrun launch: the verb runs
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "1"}):
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
        code, stdout, err = ag(*argv[:-1], tmp_path / "v2")
    assert code in (0, 1) and (tmp_path / "v2" / "validation.json").exists(), err


def test_locates_later_checkpoint_warning_names_where_the_loss_scale_came_from(tmp_path):
    # review_51h: "at their loss scale 8" for --scale 8, and "their loss scale 65536" for a bf16
    # checkpoint (none held) replayed under fp16: scaler.init_scale's
    for name, precision in (("f16", "fp16"), ("b16", "bf16")):
        ok(train(tmp_path, name, *LINEAR, "--set", f"precision={precision}", "--set", "steps=4",
                 "--set", "checkpoint.every=2"))
    base = [*LINEAR, "--set", "precision=fp16", "--set", "steps=4"]

    def warned(*argv):
        code, out, err = ag("locate", *base, *argv)
        return next(line for line in err.splitlines() if line.startswith("ampguard: warning: locate: --checkpoint"))

    f16, b16 = (tmp_path / n / "checkpoints" / "step-00000004.pt" for n in ("f16", "b16"))
    assert "the replay ran them, at --scale 8, on step 3's batch" in warned("--checkpoint", f16, "--step", "3",
                                                                             "--scale", "8")
    assert "at their loss scale " in warned("--checkpoint", f16, "--step", "3")
    assert ("the replay ran them, at scaler.init_scale 65536 (the checkpoint holds no loss scale), on step 3's batch"
            in warned("--checkpoint", b16, "--step", "3"))


@pytest.mark.parametrize("setting, shown", [("compile=1", "1"), ("fast=1.0", "1.0"), ("log.plot=0", "0"),
                                            ("diagnose.strict='1'", "the text '1'")])
def test_a_number_for_a_boolean_setting_is_refused_naming_the_key(setting, shown):
    # review_51f: pydantic's lax mode read them as true/false, where a number setting refuses a boolean
    key = setting.split("=")[0]
    assert one_error_line(ag("train", *LINEAR, "--set", setting, "--print-config")) == (
        f"ampguard: error: config: {key}: expected true or false, got {shown}")
    ok(ag("train", *LINEAR, "--set", f"{key}=yes", "--print-config"))  # (the words stay: README)


def test_a_config_that_declares_yaml_1_1_is_refused_naming_the_directive(tmp_path):
    # review_51f: read as YAML 1.2 all the same, unsaid (its 010 ten, not 8)
    (tmp_path / "y11.yaml").write_text("%YAML 1.1\n---\nsteps: 010\n", encoding="utf-8")
    (tmp_path / "y12.yaml").write_text("%YAML 1.2\n---\nsteps: 010\n", encoding="utf-8")
    assert one_error_line(ag("train", tmp_path / "y11.yaml", "--print-config")).endswith(
        "the file declares %YAML 1.1; configs are read as YAML 1.2 (010 is ten, yes is text): drop the directive, "
        "or declare %YAML 1.2")
    assert "steps: 10\n" in ok(ag("train", tmp_path / "y12.yaml", "--print-config"))
