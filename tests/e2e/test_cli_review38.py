"""Review 38f on the command line: a run's ``config.yaml`` keeps the infinities and NaNs of
``task.options`` and a resume hands them to the factory again (item 3); ``train --resume`` names
its bad ``config.yaml`` as ``report`` does (item 4); a tracker's switch and its settings combine
(item 5); a ``#`` YAML would drop is refused (item 6); an error line stays short (item 8);
settings that a run does not read are said, and a YAML merge key is named (item 10). The config
tree's side is ``tests/unit/test_config_review38.py``."""

from __future__ import annotations

import math

import pytest
import yaml

from helpers import snapshot_of

L = ["--set", "task.name=linear", "--set", "steps=2", "--set", "precision=fp32", "--set", "log.plot=false",
     "--set", "eval.enabled=false"]

FACTORY = '''
import torch
from torch import nn


def build(config):
    with open("seen.txt", "a", encoding="utf-8") as f:  # what the factory was handed, each time it is built
        f.write(repr(config.task.options) + "\\n")
    torch.manual_seed(config.seed)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(4)]
    return {"model": nn.Linear(4, 2), "data": data, "loss_fn": nn.functional.mse_loss}
'''


def _seen(tmp_path) -> list[dict]:
    return [eval(line, {"inf": math.inf, "nan": math.nan}) for line in  # noqa: S307 - our own repr lines
            (tmp_path / "seen.txt").read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------- item 3


def test_a_resume_hands_the_factory_the_inf_and_nan_the_run_began_with(cli, tmp_path):
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    options = ["--set", "task.options.cap=.inf", "--set", "task.options.low=-.inf", "--set", "task.options.n=.nan",
               "--set", "task.options.l=[.inf, 1]"]
    argv = ["train", "--set", "task.factory=fac.py:build", "--set", "steps=2", "--set", "precision=fp32",
            "--set", "log.plot=false", "--set", "log.name=f", *options]
    code, out, err = cli(*argv, "--print-config")
    assert code == 0, err
    printed = yaml.safe_load(out)["task"]["options"]
    assert printed["cap"] == math.inf and printed["low"] == -math.inf and math.isnan(printed["n"])
    code, _, err = cli(*argv)
    assert code == 0, err
    before = (tmp_path / "runs" / "f" / "config.yaml").read_text(encoding="utf-8")
    assert "cap: .inf" in before and "low: -.inf" in before and "n: .nan" in before
    code, _, err = cli("train", "--resume", "runs/f", "--set", "steps=3")
    assert code == 0, err
    first, resumed = _seen(tmp_path)
    assert resumed["cap"] == math.inf and resumed["low"] == -math.inf and math.isnan(resumed["n"])
    assert resumed["l"] == [math.inf, 1] and repr(resumed) == repr(first)  # (it was None where inf or nan had been)
    after = (tmp_path / "runs" / "f" / "config.yaml").read_text(encoding="utf-8")
    assert after == before.replace("steps: 2\n", "steps: 3\n")  # written again, bit for bit but the new steps


def test_a_resume_that_changes_an_infinity_of_task_options_is_refused(cli, tmp_path):
    # the checkpoint kept its config in JSON's mode, inf and -inf both null: a resume that turned
    # task.options.cap from inf to -inf (the factory's own setting: a fixed key) went on unsaid
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    code, _, err = cli("train", "--set", "task.factory=fac.py:build", "--set", "steps=2", "--set", "precision=fp32",
                       "--set", "log.plot=false", "--set", "log.name=g", "--set", "task.options.cap=.inf",
                       "--set", "task.options.n=.nan")
    assert code == 0, err
    before = snapshot_of(tmp_path)
    code, out, err = cli("train", "--resume", "runs/g", "--set", "steps=3", "--set", "task.options.cap=-.inf")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("ampguard: error: --resume: task.options.cap was inf in ")
    assert err.strip().endswith("now -inf; a resumed run must keep it")
    assert snapshot_of(tmp_path) == before
    code, _, err = cli("train", "--resume", "runs/g", "--set", "steps=3")  # the same inf and NaN resume
    assert code == 0, err


# ---------------------------------------------------------------------------- item 4


def test_train_resume_names_its_bad_config_yaml_as_report_does(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "log.name=u")
    assert code == 0, err
    with (tmp_path / "runs" / "u" / "config.yaml").open("a", encoding="utf-8") as f:
        f.write("bogus: 1\n")
    before = snapshot_of(tmp_path)
    code, out, err = cli("train", "--resume", "runs/u", "--set", "steps=3")
    assert (code, out) == (2, "")
    assert err == "ampguard: error: config file runs/u/config.yaml: config: bogus: unknown key\n"
    code, _, said = cli("report", "runs/u", "--no-plot")
    assert code == 2 and said == err  # the same line, word for word
    assert snapshot_of(tmp_path) == before  # nothing written, nothing changed


def test_a_resume_whose_set_mends_its_config_yaml_still_goes_on(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "log.name=m")
    assert code == 0, err
    path = tmp_path / "runs" / "m" / "config.yaml"
    path.write_text(path.read_text(encoding="utf-8").replace("steps: 2\n", "steps: abc\n"), encoding="utf-8")
    code, _, err = cli("train", "--resume", "runs/m", "--set", "steps=3")
    assert code == 0, err
    code, _, err = cli("train", "--resume", "runs/m", "--set", "steps=xyz")  # the --set's own fault: as before
    assert code == 2 and err == "ampguard: error: config: steps: expected a number, got the text 'xyz'\n"


# ---------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("sets", [["log.mlflow=true", "log.mlflow.experiment=e"],
                                  ["log.mlflow.experiment=e", "log.mlflow=true"],
                                  ["log.mlflow.experiment=e", "log.mlflow=on"]])
def test_a_tracker_switched_on_and_its_setting_combine_in_either_order(cli, sets):
    argv = ["train", *L]
    for item in sets:
        argv += ["--set", item]
    code, out, err = cli(*argv, "--print-config")
    assert code == 0, err
    assert yaml.safe_load(out)["log"]["mlflow"]["experiment"] == "e"


def test_a_file_that_switches_wandb_on_takes_a_setting_of_it(cli, tmp_path):
    (tmp_path / "c.yaml").write_text("log:\n  wandb: true\n", encoding="utf-8")
    code, out, err = cli("train", "c.yaml", "--set", "log.wandb.project=foo", "--print-config")
    assert code == 0, err
    assert yaml.safe_load(out)["log"]["wandb"]["project"] == "foo"


def test_a_tracker_switched_off_then_set_is_one_line_in_yaml_words(cli, tmp_path):
    code, out, err = cli("train", *L, "--set", "log.mlflow=false", "--set", "log.mlflow.experiment=e")
    assert (code, out) == (2, "")
    assert err.startswith("ampguard: error: --set log.mlflow.experiment: log.mlflow is false (off) in the config")
    assert err.count("\n") == 1 and "False" not in err and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- item 6


@pytest.mark.parametrize("item", ["log.name=exp #3", "log.name=#3"])
def test_a_hash_yaml_would_drop_is_refused_and_nothing_runs(cli, tmp_path, item):
    code, out, err = cli("train", *L, "--set", item)
    assert (code, out) == (2, "")
    assert err.startswith("ampguard: error: --set log.name: '#3' is a YAML comment") and "quote" in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []  # (it trained into runs/exp, or a timestamp)


def test_a_quoted_hash_names_the_run_folder(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", 'log.name="exp #3"')
    assert code == 0, err
    assert (tmp_path / "runs" / "exp #3" / "steps.csv").is_file()


# ---------------------------------------------------------------------------- item 8


def test_a_long_value_is_not_echoed_whole(cli, tmp_path):
    code, _, err = cli("train", "--set", "precision=" + "x" * 5000)
    assert code == 2 and err.count("\n") == 1 and len(err.encode()) < 300, len(err.encode())
    assert err.startswith("ampguard: error: config: precision: Input should be 'fp16', 'bf16', 'fp32' or 'fp8' (got ")


# ---------------------------------------------------------------------------- item 10


def test_settings_the_run_does_not_read_are_said_one_line_each(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "scaler.min_scale=2", "--set", "fp8.recipe=rowwise",
                       "--set", "checkpoint.enabled=false", "--set", "checkpoint.every=1", "--print-config")
    assert code == 0
    assert err.splitlines() == [
        "ampguard: warning: precision fp32 uses no loss scaler: scaler.min_scale ignored",
        "ampguard: warning: the fp8 section is read under precision: fp8 only (this run is fp32): fp8.recipe ignored",
        "ampguard: warning: checkpoint.enabled is false: checkpoint.every ignored"]
    code, _, err = cli("train", *L, "--set", "precision=fp16", "--set", "scaler.min_scale=2", "--print-config")
    assert code == 0 and err == ""  # (read: nothing to say)


def test_a_config_file_that_spells_out_every_default_says_nothing(cli, tmp_path):
    code, out, _ = cli("train", "--print-config")
    (tmp_path / "all.yaml").write_text(out, encoding="utf-8")  # (a teammate's config: every key, at its default)
    code, _, err = cli("train", "all.yaml", "--set", "precision=fp32", "--set", "checkpoint.enabled=false",
                       "--print-config")
    assert code == 0 and err == ""


def test_validate_says_it_names_its_own_folder_and_injects_nothing(cli, tmp_path):
    code, _, err = cli("validate", "--set", "task.name=linear", "--set", "validation.precisions=[bf16]",
                       "--set", "log.name=myval", "--set", "inject=[nan_loss@2]")
    assert code in (0, 1), err
    lines = err.splitlines()
    assert "ampguard: warning: validate names its report folder itself (log.dir/validate-<time>, or --out): " \
           "log.name ignored" in lines
    assert "ampguard: warning: validate injects no faults: inject ignored" in lines
    assert not (tmp_path / "runs" / "myval").exists()


def test_a_resume_says_only_what_its_own_set_gives(cli, tmp_path):
    code, _, err = cli("train", *L, "--set", "log.name=r", "--set", "fp8.recipe=rowwise")
    assert code == 0 and "fp8.recipe ignored" in err  # said when the run began
    code, _, err = cli("train", "--resume", "runs/r", "--set", "steps=3")
    assert code == 0 and "warning" not in err, err  # (its config.yaml gives every key: not said again)
    code, _, err = cli("train", "--resume", "runs/r", "--set", "steps=4", "--set", "scaler.min_scale=2")
    assert code == 0 and [line for line in err.splitlines() if "warning" in line] == [
        "ampguard: warning: precision fp32 uses no loss scaler: scaler.min_scale ignored"]


def test_a_yaml_merge_key_in_a_file_is_named(cli, tmp_path):
    (tmp_path / "c.yaml").write_text("steps: 3\noptimizer:\n  <<: {lr: 0.1}\n", encoding="utf-8")
    code, _, err = cli("train", "c.yaml", "--print-config")
    assert code == 2
    assert err == ("ampguard: error: config file c.yaml: cannot parse: YAML merge keys (<<) are not supported "
                   "(line 3): write the keys out\n")
