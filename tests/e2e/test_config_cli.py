"""``--print-config``: the effective config of a file, ``--set`` and ``--inject``, printed by
``ampguard train`` without running anything. The config tree itself is in
``tests/unit/test_config.py``."""

from __future__ import annotations

import yaml

from helpers import SAMPLE_TOML

from ampguard.config import Config, load_config, validate


def test_print_config_round_trips_with_set_values(cli, tmp_path):
    (tmp_path / "c.toml").write_text(SAMPLE_TOML, encoding="utf-8")
    sets = ["optimizer.lr=0.02", "max_norm=null", "task.batch_size=3", "log.name=pc"]
    argv = ["train", "c.toml"]
    for item in sets:
        argv += ["--set", item]
    code, out, err = cli(*argv, "--inject", "spike@4", "--print-config")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert set(printed) == set(Config.model_fields)  # every field shown
    effective = validate(printed)
    expected = load_config(tmp_path / "c.toml", sets + ["inject=[inf_grad@5, nan_loss@every:3, spike@4]"])
    assert effective == expected
    assert effective.optimizer.lr == 0.02 and effective.max_norm is None and effective.task.batch_size == 3
    assert effective.inject[-1] == "spike@4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # nothing written


def test_print_config_without_file_is_the_defaults(cli, tmp_path):
    code, out, err = cli("train", "--print-config")
    assert code == 0, err
    assert validate(yaml.safe_load(out)) == Config()
    assert list(tmp_path.iterdir()) == []


def test_print_config_accepts_max_norm_zero(cli):
    code, out, err = cli("train", "--set", "max_norm=0", "--print-config")
    assert code == 0, err
    assert yaml.safe_load(out)["max_norm"] == 0
