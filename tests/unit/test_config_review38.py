"""Review 38f, the config tree: non-finite ``task.options`` kept by ``dump_config`` (item 3), a
tracker's switch and its settings combined by ``--set`` (item 5), a ``#`` that YAML would drop
from a ``--set`` value (item 6), error lines cut short (item 8), duplicates refused alike and a
YAML merge key named (item 10). The command line's side is ``tests/e2e/test_cli_review38.py``."""

from __future__ import annotations

import math

import pytest
import yaml

from ampguard.config import apply_overrides, dump_config, load_config, read_file, read_run_config, validate
from ampguard.errors import ConfigError

# ---------------------------------------------------------------------------- item 3: inf and nan in task.options


def test_dump_config_keeps_inf_and_nan_of_task_options_and_round_trips_bit_for_bit(tmp_path):
    config = load_config(None, ["task.options.cap=.inf", "task.options.low=-.inf", "task.options.n=.nan",
                                "task.options.mixed=[.inf, 1.5, {deep: -.inf}]"])
    text = dump_config(config)
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    options = read_file(path)["task"]["options"]  # (what a resume reads: Resume.run_config)
    assert options["cap"] == math.inf and options["low"] == -math.inf and math.isnan(options["n"])
    assert options["mixed"][0] == math.inf and options["mixed"][1] == 1.5 and options["mixed"][2] == {"deep": -math.inf}
    again = read_run_config(path)  # (what report and compare read)
    assert again.task.options["cap"] == math.inf and math.isnan(again.task.options["n"])
    assert dump_config(again) == text  # written again (a resume rewrites config.yaml): the same bytes
    assert "null" not in text[text.index("options:"):text.index("batch_size:")]


def test_finite_options_and_the_rest_of_the_tree_dump_as_before():
    config = load_config(None, ["task.options.lr=1e-3", "task.options.name=010", "task.options.none=null"])
    assert yaml.safe_load(dump_config(config)) == config.model_dump(mode="json")


# ---------------------------------------------------------------------------- item 5: a switch and its settings


@pytest.mark.parametrize("tracker, key, value", [("mlflow", "experiment", "e"), ("wandb", "project", "foo")])
def test_a_switch_turned_on_then_a_setting_of_it(tracker, key, value):
    data = apply_overrides({}, [f"log.{tracker}=true", f"log.{tracker}.{key}={value}"])
    assert getattr(getattr(validate(data).log, tracker), key) == value


@pytest.mark.parametrize("switch", ["true", "on", "yes"])
def test_a_setting_then_the_switch_turned_on_keeps_the_setting(switch):
    data = apply_overrides({}, ["log.mlflow.experiment=e", f"log.mlflow={switch}"])
    assert validate(data).log.mlflow.experiment == "e"  # (it was reset to the default 'ampguard', silently)


@pytest.mark.parametrize("in_file", [True, "on", None])
def test_a_file_that_switches_a_tracker_on_or_leaves_it_null_takes_a_setting(in_file):
    # (None: a run's config.yaml holds `wandb: null`, so `train --resume ... --set log.wandb.mode=offline`)
    data = apply_overrides({"log": {"wandb": in_file}}, ["log.wandb.project=foo"])
    assert validate(data).log.wandb.project == "foo"


def test_a_switch_turned_off_then_a_setting_of_it_is_refused_in_yaml_words():
    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, ["log.mlflow=false", "log.mlflow.experiment=e"])
    said = str(caught.value)
    assert said.startswith("--set log.mlflow.experiment: log.mlflow is false (off)") and "--set log.mlflow=true" in said
    assert "False" not in said and "\n" not in said
    assert validate(apply_overrides({}, ["log.mlflow.experiment=e", "log.mlflow=false"])).log.mlflow is None  # off wins


def test_a_plain_setting_in_the_way_is_shown_as_yaml_writes_it():
    with pytest.raises(ConfigError, match=r"^--set task\.name: task is true in the config, not a section$"):
        apply_overrides({"task": True}, ["task.name=linear"])


# ---------------------------------------------------------------------------- item 6: '#' in a --set value


@pytest.mark.parametrize("item, comment", [("log.name=exp #3", "'#3'"), ("log.name=#3", "'#3'"),
                                           ("task.options.note=a #b", "'#b'")])
# (a list, `inject=[nan_loss@2] # the usual`, is told to leave the comment out: test_config_review39.py)
def test_a_yaml_comment_in_a_set_value_is_refused_saying_to_quote_it(item, comment):
    key = item.partition("=")[0]
    with pytest.raises(ConfigError) as caught:
        apply_overrides({}, [item])
    said = str(caught.value)
    assert said.startswith(f"--set {key}: {comment} is a YAML comment") and "quote" in said and "\n" not in said


def test_a_hash_inside_a_word_or_in_quotes_is_the_values_own():
    data = apply_overrides({}, ["log.name=exp#3", "log.wandb.name='exp #3'", 'log.mlflow.run_name="#3"', "steps=3"])
    config = validate(data)
    assert (config.log.name, config.log.wandb.name, config.log.mlflow.run_name, config.steps) == (
        "exp#3", "exp #3", "#3", 3)


# ---------------------------------------------------------------------------- item 8: error lines cut short


@pytest.mark.parametrize("item", ["precision=" + "x" * 5000, "log.name=" + "a/" * 2500, "steps=" + "9" * 4000,
                                  "seed=-" + "9" * 4000, "optimizer.name=" + "y" * 5000,
                                  "fp32_modules=[" + "m" * 5000 + ", " + "m" * 5000 + "]",
                                  'log.dir="' + "d\\x01" * 2500 + '"', "s" * 5000])
def test_a_refusal_does_not_echo_a_long_value_whole(item):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [item])
    assert len(str(caught.value)) < 300 and "\n" not in str(caught.value), str(caught.value)[:400]


def test_a_short_value_is_still_shown_whole():
    with pytest.raises(ConfigError, match=r"^config: precision: Input should be .* \(got 'fp4'\)$"):
        load_config(None, ["precision=fp4"])


# ---------------------------------------------------------------------------- item 10: duplicates, merge keys


@pytest.mark.parametrize("item, key", [("fp8.exclude=[a, b, a]", "fp8.exclude"),
                                       ("log.wandb.tags=[t, t]", "log.wandb.tags"),
                                       ("fp32_modules=[x, x]", "fp32_modules")])
def test_a_name_listed_twice_is_refused_alike(item, key):
    with pytest.raises(ConfigError, match=rf"^config: {key}: \w listed more than once$"):
        load_config(None, [item])


def test_a_run_saved_with_a_name_twice_reads_as_it_ran(tmp_path):
    # (before they were refused: a run folder's config.yaml may hold them; report and compare read it)
    data = yaml.safe_load(dump_config(validate({})))
    data["fp8"]["exclude"], data["log"]["wandb"] = ["head", "head"], {"tags": ["t", "t"]}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    config = read_run_config(tmp_path / "config.yaml")
    assert config.fp8.exclude == ["head"] and config.log.wandb.tags == ["t"]


def test_a_yaml_merge_key_is_named_in_a_file_and_in_a_set_value(tmp_path):
    (tmp_path / "c.yaml").write_text("steps: 3\noptimizer:\n  <<: {lr: 0.1}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        read_file(tmp_path / "c.yaml")
    assert str(caught.value) == (f"config file {tmp_path / 'c.yaml'}: cannot parse: YAML merge keys (<<) are not "
                                 "supported (line 3): write the keys out")
    with pytest.raises(ConfigError, match=r"^--set optimizer: cannot parse value .*YAML merge keys \(<<\) are not "
                                          r"supported"):
        apply_overrides({}, ["optimizer={<<: {lr: 3}}"])
    assert validate(apply_overrides({}, ["log.name=<<"])).log.name == "<<"  # (a value `<<` is text)
