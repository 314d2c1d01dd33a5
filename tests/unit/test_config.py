"""The typed config tree: defaults, file formats, --set, dump_config. ``--print-config`` on the
command line is in ``tests/e2e/test_config_cli.py``."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from helpers import SAMPLE, SAMPLE_TOML

from ampguard.config import Config, apply_overrides, dump_config, load_config, read_file, validate
from ampguard.errors import ConfigError, InputError


# ---------------------------------------------------------------------------- defaults


def test_defaults_from_design():
    # The contract fixes these defaults; the loaded config (no file, no --set) must carry them.
    c = load_config()
    assert (c.scaler.init_scale, c.scaler.growth_factor, c.scaler.backoff_factor, c.scaler.growth_interval) == (
        65536.0, 2.0, 0.5, 2000)
    assert (c.monitor.window, c.monitor.alert_rate, c.monitor.fail_after) == (1000, 0.05, 100)
    assert c.inject == []
    # The guard rails' own defaults: the scale's floor, and when the skip-rate ALERT arms.
    assert (c.scaler.min_scale, c.monitor.min_steps) == (1.0, 100)
    assert c.monitor.fail_rate is None and c.monitor.fail_on_scale_collapse is False
    assert c.max_norm == 1.0  # seed 000: "max_norm = 1.0" in the config


def test_required_sections_and_fields_exist():
    data = Config().model_dump()
    for key in ("precision", "max_norm", "accumulation_steps", "steps", "seed", "device",
                "optimizer", "schedule", "scaler", "monitor", "log", "checkpoint", "task", "inject"):
        assert key in data, key
    assert {"lr", "weight_decay", "betas", "fused"} <= set(data["optimizer"])
    assert {"warmup", "decay"} <= set(data["schedule"])
    assert {"init_scale", "growth_factor", "backoff_factor", "growth_interval"} <= set(data["scaler"])
    assert {"window", "alert_rate", "fail_rate", "fail_after"} <= set(data["monitor"])
    assert {"dir", "every"} <= set(data["log"])
    assert {"every", "keep"} <= set(data["checkpoint"])


def test_every_field_is_documented():
    def check(model):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no docstring"
    for section in ("optimizer", "schedule", "scaler", "monitor", "log", "checkpoint", "task"):
        check(type(getattr(Config(), section)))
    for name, info in Config.model_fields.items():
        if name not in ("optimizer", "schedule", "scaler", "monitor", "log", "checkpoint", "task"):
            assert info.description, name


def test_no_file_no_overrides_is_the_defaults():
    assert load_config() == Config()
    assert validate({}) == Config()


def test_empty_yaml_file_is_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    assert load_config(path) == Config()


# ---------------------------------------------------------------------------- files


def test_yaml_json_toml_load_to_the_same_config(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(SAMPLE), encoding="utf-8")
    (tmp_path / "c.yml").write_text(yaml.safe_dump(SAMPLE, default_flow_style=True), encoding="utf-8")
    (tmp_path / "c.json").write_text(json.dumps(SAMPLE, indent=2), encoding="utf-8")
    (tmp_path / "c.toml").write_text(SAMPLE_TOML, encoding="utf-8")
    (tmp_path / "C.YAML").write_text(yaml.safe_dump(SAMPLE), encoding="utf-8")
    configs = [load_config(tmp_path / name) for name in ("c.yaml", "c.yml", "c.json", "c.toml", "C.YAML")]
    expected = validate(SAMPLE)
    for config in configs:
        assert config == expected
        assert config.model_dump() == expected.model_dump()
    assert expected != Config()
    assert expected.optimizer.betas == (0.8, 0.99) and expected.scaler.init_scale == 1024
    assert expected.inject == ["inf_grad@5", "nan_loss@every:3"]


def test_read_file_returns_plain_mapping(tmp_path):
    (tmp_path / "c.toml").write_text(SAMPLE_TOML, encoding="utf-8")
    assert read_file(tmp_path / "c.toml") == SAMPLE


@pytest.mark.parametrize(
    ("name", "text", "names"),
    [
        ("a.yaml", "steps: [1,\n", "a.yaml"),
        ("a.json", "{", "a.json"),
        ("a.toml", "x = = 1", "a.toml"),
        ("a.yaml", "- a\n", "a.yaml"),
        ("a.yaml", "just a string\n", "a.yaml"),
        ("a.cfg", "steps: 3\n", ".cfg"),
    ],
)
def test_unreadable_files_are_config_errors(tmp_path, name, text, names):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert names in str(info.value) and "\n" not in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(InputError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"optimizer": {"bogus": 1}}, "optimizer.bogus"),
        ({"steps": "many"}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"max_norm": math.nan}, "max_norm"),
        ({"max_norm": math.inf}, "max_norm"),
        ({"accumulation_steps": 0}, "accumulation_steps"),
        ({"optimizer": {"lr": math.nan}}, "optimizer.lr"),
        ({"optimizer": {"lr": -1e-3}}, "optimizer.lr"),
        ({"optimizer": {"betas": [0.9, 1.0]}}, "optimizer.betas"),
        ({"scaler": {"backoff_factor": 1.0}}, "scaler.backoff_factor"),
        ({"scaler": {"backoff_factor": 0.0}}, "scaler.backoff_factor"),
        ({"scaler": {"growth_factor": 1.0}}, "scaler.growth_factor"),
        ({"scaler": {"growth_interval": 0}}, "scaler.growth_interval"),
        ({"scaler": {"init_scale": 0}}, "scaler.init_scale"),
        ({"scaler": {"min_scale": 0}}, "scaler.min_scale"),
        ({"scaler": {"min_scale": -1.0}}, "scaler.min_scale"),
        ({"scaler": {"min_scale": 2.0**-127}}, "scaler.min_scale"),  # subnormal float32: 1/scale overflows
        ({"scaler": {"min_scale": math.inf}}, "scaler.min_scale"),
        ({"scaler": {"min_scale": math.nan}}, "scaler.min_scale"),
        ({"scaler": {"init_scale": 4.0, "min_scale": 8.0}}, "scaler.min_scale"),
        ({"scaler": {"init_scale": 1e39}}, "scaler.init_scale"),  # past float32: the scale tensor overflows
        ({"scaler": {"growth_interval": 2**31}}, "scaler.growth_interval"),  # past the int32 growth tracker
        ({"monitor": {"min_steps": -1}}, "monitor.min_steps"),
        ({"monitor": {"min_steps": 2.5}}, "monitor.min_steps"),
        ({"monitor": {"min_steps": True}}, "monitor.min_steps"),
        ({"precision": "fp4"}, "precision"),
        ({"precision": "bf16", "scaler": {"enabled": True}}, "scaler.enabled"),
        ({"precision": "fp32", "scaler": {"enabled": True}}, "scaler.enabled"),
        ({"monitor": {"alert_rate": 1.5}}, "monitor.alert_rate"),
        ({"monitor": {"window": 0}}, "monitor.window"),
        ({"log": {"every": 0}}, "log.every"),
        ({"log": {"name": "a/b"}}, "log.name"),
        ({"checkpoint": {"keep": 0}}, "checkpoint.keep"),
        ({"inject": ["inf_grad@0"]}, "inject"),
        ({"inject": "inf_grad@5"}, "inject"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as info:
        validate(data)
    message = str(info.value)
    assert key in message, message
    assert "\n" not in message


@pytest.mark.parametrize(("data", "key"), [({"steps": True}, "steps"), ({"max_norm": True}, "max_norm"),
                                           ({"optimizer": {"lr": False}}, "optimizer.lr")])
def test_booleans_are_not_numbers(data, key):
    with pytest.raises(ConfigError, match=key):
        validate(data)


@pytest.mark.parametrize("value", [0, 0.0, None, -1.0, -0.1])
def test_max_norm_zero_or_below_or_null_is_allowed(value, tmp_path):
    # DESIGN: "max_norm <= 0 or null disables clipping (post = pre)"
    assert validate({"max_norm": value}).max_norm == value
    path = tmp_path / "c.yaml"
    path.write_text(f"max_norm: {'null' if value is None else value}\n", encoding="utf-8")
    assert load_config(path).max_norm == value


def test_min_scale_edges_that_are_allowed():
    assert validate({"scaler": {"min_scale": 2.0**-126}}).scaler.min_scale == 2.0**-126  # smallest normal
    assert validate({"scaler": {"init_scale": 8.0, "min_scale": 8.0}}).scaler.min_scale == 8.0  # floor = start
    biggest = float(torch.finfo(torch.float32).max)
    assert validate({"scaler": {"init_scale": biggest}}).scaler.init_scale == biggest  # the largest float32
    assert validate({"monitor": {"min_steps": 0}}).monitor.min_steps == 0  # armed from step 1


def test_min_scale_and_min_steps_from_set_and_print_config(tmp_path):
    c = load_config(None, ["precision=fp16", "scaler.min_scale=0.25", "monitor.min_steps=7"])
    assert (c.scaler.min_scale, c.monitor.min_steps) == (0.25, 7)
    dumped = yaml.safe_load(dump_config(c))
    assert dumped["scaler"]["min_scale"] == 0.25 and dumped["monitor"]["min_steps"] == 7
    assert validate(dumped) == c


def test_min_scale_above_init_scale_message_names_both_keys():
    with pytest.raises(ConfigError) as info:
        validate({"scaler": {"init_scale": 4.0, "min_scale": 8.0}})
    assert str(info.value) == "config: scaler.min_scale: the floor (8) must be <= scaler.init_scale (4)"


def test_clear_rate_reaches_the_monitor_and_above_alert_rate_is_refused():
    from ampguard.build import build_monitor

    assert build_monitor(validate({"monitor": {"clear_rate": 0.01}}), scaler_enabled=False).clear_rate == 0.01
    assert build_monitor(validate({"monitor": {"alert_rate": 0.1}}), scaler_enabled=False).clear_rate == pytest.approx(0.08)
    assert validate({"monitor": {"clear_rate": 0.05}}).monitor.clear_rate == 0.05  # = alert_rate: no band
    with pytest.raises(ConfigError) as info:
        validate({"monitor": {"alert_rate": 0.05, "clear_rate": 0.2}})
    assert str(info.value) == ("config: monitor.clear_rate: the ALERT's clear level (0.2) must be <= "
                               "monitor.alert_rate (0.05)")


def test_scaler_enabled_allowed_for_fp16_and_false_for_bf16():
    assert validate({"precision": "fp16", "scaler": {"enabled": True}}).scaler.enabled is True
    assert validate({"precision": "bf16", "scaler": {"enabled": False}}).scaler.enabled is False


# ---------------------------------------------------------------------------- --set


def test_set_values_are_yaml_scalars():
    data = apply_overrides({}, [
        "optimizer.lr=1e-3", "max_norm=null", "optimizer.fused=true", "steps=12", "precision=fp16",
        "optimizer.betas=[0.8, 0.9]", "log.name=abc", "schedule.min_lr_ratio=0", "inject=[inf_grad@5]",
        "monitor.fail_rate=",
    ])
    c = validate(data)
    assert c.optimizer.lr == 1e-3 and isinstance(c.optimizer.lr, float)
    assert c.max_norm is None
    assert c.optimizer.fused is True
    assert c.steps == 12 and isinstance(c.steps, int)
    assert c.precision == "fp16"
    assert c.optimizer.betas == (0.8, 0.9)
    assert c.log.name == "abc"
    assert c.schedule.min_lr_ratio == 0
    assert c.inject == ["inf_grad@5"]
    assert c.monitor.fail_rate is None


def test_set_overrides_a_file_and_keeps_the_rest(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(SAMPLE), encoding="utf-8")
    c = load_config(path, ["optimizer.lr=0.2", "scaler.growth_interval=7"])
    assert c.optimizer.lr == 0.2 and c.scaler.growth_interval == 7
    assert c.optimizer.name == "sgd" and c.scaler.init_scale == 1024  # siblings kept
    assert c.steps == 7


def test_later_set_wins_and_input_is_not_mutated():
    data = {"optimizer": {"lr": 0.5}}
    out = apply_overrides(data, ["optimizer.lr=0.1", "optimizer.lr=0.3"])
    assert out["optimizer"]["lr"] == 0.3
    assert data == {"optimizer": {"lr": 0.5}}


@pytest.mark.parametrize("item", ["steps", "=3", "optimizer..lr=1", ".lr=1"])
def test_set_needs_key_equals_value(item):
    with pytest.raises(ConfigError):
        apply_overrides({}, [item])


def test_set_below_a_scalar_names_the_key():
    with pytest.raises(ConfigError, match="steps"):
        apply_overrides({"steps": 5}, ["steps.x=1"])
    with pytest.raises(ConfigError, match="steps"):
        load_config(None, ["steps.x=1"])


# ---------------------------------------------------------------------------- dump_config


def test_dump_config_round_trips():
    for config in (Config(), validate(SAMPLE), validate({"max_norm": None, "precision": "fp32"})):
        assert validate(yaml.safe_load(dump_config(config))) == config


@pytest.mark.parametrize("name", ["off", "yes", "no", "on", "2024", "1.5"])
def test_a_name_that_yaml_1_1_reads_as_a_bool_or_a_number_is_the_name(name):
    # --set log.name=off was refused ("Input should be a valid string (got False)"), 2024 too
    assert load_config(None, [f"log.name={name}"]).log.name == name


def test_boolean_settings_still_read_yes_no_on_off(tmp_path):
    for word, value in (("off", False), ("no", False), ("yes", True), ("on", True), ("true", True), ("False", False)):
        assert load_config(None, ["precision=fp16", f"scaler.enabled={word}"]).scaler.enabled is value
        path = tmp_path / "c.yaml"
        path.write_text(f"precision: fp16\nscaler:\n  enabled: {word}\n", encoding="utf-8")
        assert load_config(path).scaler.enabled is value


@pytest.mark.parametrize("word,on", [("yes", True), ("on", True), ("true", True), ("no", False), ("off", False)])
def test_a_tracker_switch_takes_the_words_a_boolean_setting_takes(word, on):
    # YAML 1.2 reads yes/on/no/off as text: log.wandb=yes was refused ("a valid dictionary")
    config = load_config(None, [f"log.wandb={word}", f"log.mlflow={word}"])
    assert (config.log.wandb is not None, config.log.mlflow is not None) == (on, on)


# ---------------------------------------------------------------------------- error hints


@pytest.mark.parametrize("setting, line", [
    ("optimzer.lr=1e-3", "config: optimzer: unknown key (did you mean optimizer?)"),
    ("task.nmae=x", "config: task.nmae: unknown key (did you mean name?)"),
    ("monitor.headroom.evry=3", "config: monitor.headroom.evry: unknown key (did you mean every?)"),
    ("log.wandb.projct=x", "config: log.wandb.projct: unknown key (did you mean project?)"),
    ("validation.outputs.box.abs_tl=1", "config: validation.outputs.box.abs_tl: unknown key (did you mean abs_tol?)"),
    ("nope=1", "config: nope: unknown key"),  # nothing close: no guess
    ("task.zzz=1", "config: task.zzz: unknown key"),
])
def test_an_unknown_key_names_the_close_known_one(setting, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    assert str(err.value) == line


@pytest.mark.parametrize("setting", ["max_norm=none", "max_norm=None", "monitor.fail_rate=NONE", "optimizer.fused=nil",
                                     "monitor.headroom.every=None", "validation.outputs.box.abs_tol=nil",
                                     "task.preset=none"])
def test_a_null_written_as_none_or_nil_says_how_null_is_written(setting):
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    key, _, word = setting.partition("=")
    line = str(err.value)
    assert line.startswith(f"config: {key}: ") and line.endswith(
        (f"(got {word!r}) (null is written null)", f"got the text {word!r} (null is written null)")), line
    assert "\n" not in line


@pytest.mark.parametrize("setting", ["steps=None", "optimizer.lr=nil", "max_norm=nul"])
def test_no_null_hint_for_a_key_that_takes_no_null_or_another_word(setting):
    # steps and optimizer.lr take no null; "nul" is not a way of writing null
    with pytest.raises(ConfigError) as err:
        load_config(None, [setting])
    assert "null is written" not in str(err.value)


@pytest.mark.parametrize("key", ["wandb", "mlflow"])
def test_a_tracker_switch_that_is_neither_a_switch_nor_a_mapping_says_what_it_takes(key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"log.{key}=maybe"])
    assert str(err.value) == f"config: log.{key}: expected true, false, null or a mapping of its settings (got 'maybe')"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"log.{key}=None"])
    assert str(err.value) == (f"config: log.{key}: expected true, false, null or a mapping of its settings "
                              "(got 'None') (null is written null)")
    assert load_config(None, [f"log.{key}=null"]).log.model_dump()[key] is None


def test_a_rollback_trigger_is_listed_once():
    # review_27e: [loss_spike, loss_spike] was taken, a typo for another trigger gone unsaid
    with pytest.raises(ConfigError, match=r"^config: rollback.triggers: loss_spike listed more than once$"):
        validate({"rollback": {"triggers": ["loss_spike", "loss_spike"]}, "checkpoint": {"every": 5}})


def test_a_fault_is_listed_once_and_a_flag_repeating_the_files_own_adds_nothing():
    # review_session10: `--inject X` given again on `--resume` (the run's own command line) appended X to
    # the run's config.yaml, which held it already: the fault fired twice (spike@5 twice is x 1e16)
    assert load_config(base={"inject": ["spike@5"]}, inject=["spike@5", "nan_loss@3"]).inject == ["spike@5", "nan_loss@3"]
    with pytest.raises(ConfigError) as info:
        validate({"inject": ["spike@5", "nan_loss@3", "spike@5"]})
    assert str(info.value) == "config: inject: spike@5 listed more than once (each listing fires: list it once)"
    # the same flag given twice is refused as the demo refuses it (train folded it into one, unsaid)
    with pytest.raises(ConfigError, match="^config: inject: nan_loss@3 listed more than once"):
        load_config(base={"inject": ["spike@5"]}, inject=["nan_loss@3", "spike@5", "nan_loss@3"])


@pytest.mark.parametrize("key, value", [("optimizer.lr", "1e39"), ("optimizer.lr", str(10**44)),
                                        ("optimizer.weight_decay", "1e300"), ("optimizer.eps", "1e300"),
                                        ("scaler.growth_factor", "1e300"), ("scaler.init_scale", "1e39")])
def test_a_setting_the_step_applies_to_float32_tensors_is_at_most_the_largest_float32(key, value):
    # (review 48c: optimizer.lr=1e39 passed, then step 1 raised "value cannot be converted to type
    # float without overflow": a 61-line traceback, exit 1, a run folder left behind)
    with pytest.raises(ConfigError, match=rf"^config: {key}: must be <= 3.40282e\+38, the largest float32 "):
        load_config(None, [f"{key}={value}"])
    biggest = float(torch.finfo(torch.float32).max)
    assert load_config(None, [f"{key}={biggest!r}", "optimizer.name=sgd"]) is not None  # (the edge itself: taken)


def test_adamw_refuses_an_lr_its_first_step_scales_past_float32():
    # (review 48e: lr=1e38 passed the float32 cap, then AdamW's lr / (1 - beta1) = 1e39 raised at step 1)
    with pytest.raises(ConfigError, match=r"^config: optimizer.lr: AdamW's first step scales it by 1 / \(1 - betas\[0\]\) "
                                          r"\(1e\+38 / 0.1\), past the largest float32"):
        load_config(None, ["optimizer.lr=1e38", "optimizer.weight_decay=0"])
    assert load_config(None, ["optimizer.lr=3e37", "optimizer.weight_decay=0"]).optimizer.lr == 3e37
    assert load_config(None, ["optimizer.name=sgd", "optimizer.lr=1e38"]).optimizer.lr == 1e38


def test_adamw_refuses_a_decay_that_zeroes_or_flips_the_weights_and_sgd_takes_it():
    # (review 48c: weight_decay 1e300 applied step 1, every weight non-finite, then every step skipped, exit 0)
    with pytest.raises(ConfigError, match=r"^config: optimizer.weight_decay: AdamW multiplies every weight by "
                                          r"1 - lr x weight_decay each step \(1 - 0.01 x 100\)"):
        load_config(None, ["optimizer.lr=0.01", "optimizer.weight_decay=100"])
    assert load_config(None, ["optimizer.lr=0.01", "optimizer.weight_decay=99"]).optimizer.weight_decay == 99
    assert load_config(None, ["optimizer.name=sgd", "optimizer.lr=0.01", "optimizer.weight_decay=100"])
