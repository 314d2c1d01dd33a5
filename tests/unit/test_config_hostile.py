"""Hostile and careless config files: each refused with one ConfigError line, quickly, nothing run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import yaml

from helpers import deadline

from ampguard.config import (
    MAX_DEPTH, MAX_FILE_BYTES, MAX_NAME, MAX_SEED, _PlainLoader, dump_config, load_config, read_file, validate,
)
from ampguard.errors import ConfigError
from ampguard.tasks import build_task


def _refused(path, *needles: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "\n" not in text
    for needle in needles:
        assert needle in text, text
    return text


def test_a_608_byte_billion_laughs_yaml_is_refused_at_once(tmp_path, monkeypatch):
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert path.stat().st_size < 700
    # Spies (each calls the real method): the alias events composition reaches, and whether any
    # document gets constructed at all (the expansion would happen there, and past it).
    aliases_seen, constructed = [], []
    compose_node, construct_document = _PlainLoader.compose_node, _PlainLoader.construct_document

    def counting_compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            aliases_seen.append(self.peek_event().anchor)
        return compose_node(self, parent, index)

    def counting_construct_document(self, node):
        constructed.append(node)
        return construct_document(self, node)

    monkeypatch.setattr(_PlainLoader, "compose_node", counting_compose_node)
    monkeypatch.setattr(_PlainLoader, "construct_document", counting_construct_document)
    with deadline(30):  # fails on a hang (an expansion), never on a slow machine
        text = _refused(path, "aliases", "not allowed")
    assert "line 2" in text  # the first alias, *a0 in the line of a1
    assert aliases_seen == ["a0"]  # refused at the first alias: none of the other 71 was composed
    assert constructed == []  # refused while composing: nothing was built, so nothing expanded


def test_a_recursive_alias_is_refused(tmp_path):
    path = tmp_path / "rec.yaml"
    path.write_text("a: &a [*a]\n", encoding="utf-8")
    _refused(path, "aliases")


def test_an_anchor_without_an_alias_is_fine(tmp_path):
    path = tmp_path / "anchor.yaml"
    path.write_text("optimizer: &opt\n  lr: 0.01\n", encoding="utf-8")
    assert load_config(path).optimizer.lr == 0.01


@pytest.mark.parametrize("name, text, what", [
    ("date.yaml", "steps: 2020-01-01\n", "steps: a date"),
    ("binary.yaml", "task:\n  name: !!binary aGVsbG8=\n", "task.name: a bytes"),
    ("set.yaml", "inject: !!set {a: null}\n", "inject: a set"),
    ("date.toml", "[task]\nname = 1979-05-27\n", "task.name: a date"),
    ("time.toml", "steps = 07:32:00\n", "steps: a time"),
    ("boolkey.yaml", "monitor:\n  true: 2\n", "monitor: key True is not a string"),  # (a number key is its text)
])
def test_values_that_are_not_plain_data_name_their_key(tmp_path, name, text, what):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    _refused(path, what)


def test_200k_deep_json_is_refused_not_a_recursion_traceback(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000, encoding="utf-8")
    _refused(path, "nested more than")


@pytest.mark.parametrize("depth, ok", [(MAX_DEPTH, True), (MAX_DEPTH + 1, False)])
def test_nesting_at_the_limit_reads_and_one_more_level_is_refused(tmp_path, depth, ok):
    path = tmp_path / "nest.json"
    # depth levels below the top-level mapping, as a list of lists under one key
    path.write_text('{"x": ' + "[" * depth + "]" * depth + "}", encoding="utf-8")
    if ok:
        assert "x" in read_file(path)
    else:
        with pytest.raises(ConfigError, match="nested more than"):
            read_file(path)


def test_a_file_over_the_size_limit_is_refused_without_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * MAX_FILE_BYTES + "\n", encoding="utf-8")
    _refused(path, "larger than")


def test_set_values_follow_the_same_rules():
    with pytest.raises(ConfigError, match="--set steps"):
        load_config(None, ["steps=*a"])
    with pytest.raises(ConfigError, match="steps: a date"):
        load_config(None, ["steps=2020-01-01"])


@pytest.mark.parametrize("seed, ok", [(0, True), (MAX_SEED, True), (MAX_SEED + 1, False), (2**64, False), (-1, False)])
def test_seed_bounds(seed, ok):
    if ok:
        assert load_config(None, [f"seed={seed}"]).seed == seed
    else:
        with pytest.raises(ConfigError, match="seed"):
            load_config(None, [f"seed={seed}"])


def test_a_long_run_name_is_refused_before_any_folder_exists():
    assert load_config(None, [f"log.name={'x' * MAX_NAME}"]).log.name == "x" * MAX_NAME
    with pytest.raises(ConfigError, match=f"log.name: at most {MAX_NAME} bytes"):
        load_config(None, [f"log.name={'x' * 256}"])


def test_building_a_task_seeds_random_and_numpy_with_the_run_seed():
    config = load_config(None, ["task.name=linear", "seed=7"])
    build_task(config)
    first = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    build_task(config)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == first
    build_task(load_config(None, ["task.name=linear", "seed=8"]))
    assert random.random() != first[0]


def test_a_byte_order_mark_is_read_past_and_tilde_in_log_dir_is_home(tmp_path, monkeypatch):
    # Windows editors write a BOM: JSON and TOML refused it ("Unexpected UTF-8 BOM"), YAML read it;
    # `--set log.dir=~/runs` made a folder named ~ in the working folder (the rm -rf ~ trap)
    from ampguard.config import load_config, read_file

    for name, text in (("c.json", '{"steps": 3}'), ("c.toml", "steps = 3\n"), ("c.yaml", "steps: 3\n")):
        (tmp_path / name).write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert read_file(tmp_path / name) == {"steps": 3}, name
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_config(None, ["log.dir=~/runs"]).log.dir == str(tmp_path / "home" / "runs")
    config = load_config(None, ["log.wandb={dir: ~/wb}", "validation.checkpoint=~/c.pt", "task.factory=~/f.py:build"])
    assert (config.log.wandb.dir, config.validation.checkpoint, config.task.factory) == (
        str(tmp_path / "home" / "wb"), str(tmp_path / "home" / "c.pt"), str(tmp_path / "home" / "f.py:build"))


# ---------------------------------------------------------------------------- YAML 1.2 numbers
# The README says configs are YAML 1.2; PyYAML's 1.1 number forms were read: --set log.name=010
# wrote runs/8 (octal), seed: 010 seeded 8, steps=1:30 trained 90 steps (base 60), 1_000 was 1000,
# task.options.lr=1e-3 reached the factory as the text "1e-3", and 1.2's octal 0o17 was refused.


def _both_ways(tmp_path, key: str, raw: str):
    """The config with ``key`` set to ``raw``, by --set and by a YAML file (nested as written)."""
    *sections, last = key.split(".")
    text = "".join(f"{'  ' * i}{part}:\n" for i, part in enumerate(sections)) + f"{'  ' * len(sections)}{last}: {raw}\n"
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return load_config(None, [f"{key}={raw}"]), load_config(path)


@pytest.mark.parametrize("key, raw, value", [
    ("log.name", "010", "010"),  # a setting that is text takes a number as written: not "8", not "10"
    ("log.name", "007", "007"),
    ("log.name", "0x10", "0x10"),
    ("log.name", "1e3", "1e3"),
    ("log.name", ".inf", ".inf"),
    ("log.name", "1:30", "1:30"),
    ("seed", "010", 10),  # decimal with a leading zero, not octal 8
    ("seed", "0100", 100),
    ("steps", "0o17", 15),  # YAML 1.2's octal
    ("steps", "0x10", 16),
    ("task.options.lr", "1e-3", 0.001),  # a float, not the text "1e-3"
    ("task.options.x", "1E5", 100000.0),
    ("task.options.x", ".5", 0.5),
    ("task.options.x", "5.", 5.0),
    ("task.options.x", "-1.5e+3", -1500.0),
    ("task.options.x", "010", 10),
    ("task.options.x", "1:30", "1:30"),  # no longer numbers: text, as YAML 1.2 reads them
    ("task.options.x", "1_000", "1_000"),
    ("task.options.x", "0b11", "0b11"),
])
def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path, key, raw, value):
    for config in _both_ways(tmp_path, key, raw):
        got = config.model_dump()
        for part in key.split("."):
            got = got[part]
        assert got == value and type(got) is type(value), (raw, got)


def test_a_number_read_as_a_mapping_key_is_its_text():
    # keys are names: `{010: x}` was refused as "key 10 is not a string", a key never written
    for config in (load_config(None, ["log.mlflow.tags={010: x, 1e3: y}"]),
                   load_config(None, ["task.options={1: a}"])):
        assert config.log.mlflow is None or config.log.mlflow.tags == {"010": "x", "1e3": "y"}
    assert load_config(None, ["task.options={1: a}"]).task.options == {"1": "a"}


def test_a_number_past_int_digits_is_one_short_line_that_says_why():
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"seed={'9' * 5000}"])
    line = str(info.value)
    assert line.startswith("--set seed: cannot parse value '9999") and len(line) < 300 and "4300 digits" in line


@pytest.mark.parametrize("key, raw", [("steps", "1:30"), ("steps", "1_000"), ("seed", "0b11"), ("optimizer.lr", "1_0.5")])
def test_a_1_1_only_number_where_a_number_belongs_is_refused_in_one_line(tmp_path, key, raw):
    # text where a number belongs, refused as any other text there (steps=abc) is
    for how in ("--set", "file"):
        with pytest.raises(ConfigError) as info:
            _both_ways(tmp_path, key, raw) if how == "file" else load_config(None, [f"{key}={raw}"])
        assert str(info.value) == f"config: {key}: expected a number, got the text {raw!r}", how
    with pytest.raises(ConfigError, match=r"--set steps: cannot parse value"):
        load_config(None, ["steps=!!int 1:30"])  # an explicit tag takes only YAML 1.2's forms too


# review_session26: DESIGN section 5 says wrong types are errors that name the key, but pydantic's lax
# mode read text that looks like a number as that number: `steps: "2"` trained 2 steps, `lr: "1e-3"`
# and a JSON file's "0.1" were taken; each format's quoted number is now refused naming the key
@pytest.mark.parametrize("suffix, text", [
    (".yaml", 'steps: "2"\n'), (".yaml", "optimizer:\n  lr: '1e-3'\n"), (".yaml", "optimizer:\n  betas: ['0.9', 0.95]\n"),
    (".json", '{"monitor": {"fail_rate": "0.1"}}'), (".toml", 'seed = "7"\n'), (".toml", '[scaler]\ninit_scale = "65536"\n'),
])
def test_a_number_written_as_text_is_a_wrong_type_named_by_its_key(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    line = str(info.value)
    key = {"steps": "steps", "lr": "optimizer.lr", "betas": "optimizer.betas.0", "fail_rate": "monitor.fail_rate",
           "seed": "seed", "init_scale": "scaler.init_scale"}
    named = next(full for short, full in key.items() if short in text)
    assert line.startswith(f"config: {named}: expected a number, got the text '") and "\n" not in line, line
    with pytest.raises(ConfigError, match=r"^config: steps: expected a number, got the text '2'$"):
        load_config(None, ["steps='2'"])  # --set, quoted as YAML quotes text


def test_a_whole_float_where_a_count_belongs_stays_a_number_and_a_fraction_is_refused(tmp_path):
    # YAML 1.2 reads 1e4 as a float; a whole one is the count it names, 2.5 steps is no count
    path = tmp_path / "c.yaml"
    path.write_text("steps: 1e4\nseed: 3.0\n", encoding="utf-8")
    config = load_config(path)
    assert (config.steps, config.seed) == (10000, 3) and type(config.steps) is int
    with pytest.raises(ConfigError, match=r"^config: steps: .*fractional part"):
        load_config(None, ["steps=2.5"])


@pytest.mark.parametrize("name", ["010", "1:30", "1e3", "0o7", "0x10", ".inf", "-.inf", ".NaN", "1E5", "5.", "-0",
                                  "0b11", "1_000", "off"])
def test_print_config_round_trips_a_name_that_reads_as_a_number(tmp_path, name):
    config = load_config(None, [f"log.name={name}", "task.options={s: '1e3', lr: 1e-3}"])
    assert config.log.name == name
    text = dump_config(config)  # what --print-config prints and a run's config.yaml holds
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == config  # read back as YAML 1.2
    assert validate(yaml.safe_load(text)) == config  # and by a YAML 1.1 reader
    assert load_config(path).task.options == {"s": "1e3", "lr": 0.001}
