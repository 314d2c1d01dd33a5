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


def test_a_misspelt_key_on_the_command_line_is_one_line_with_a_guess(cli, tmp_path):
    code, out, err = cli("train", "--set", "optimzer.lr=1e-3", "--set", "log.name=x")
    assert code == 2 and out == ""
    assert err == "ampguard: error: config: optimzer: unknown key (did you mean optimizer?)\n"
    code, out, err = cli("train", "--set", "max_norm=None", "--set", "log.name=x")
    assert code == 2 and err.count("\n") == 1 and err.rstrip().endswith("got the text 'None' (null is written null)")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_misspelt_key_in_a_file_gets_the_guess_too(cli, tmp_path):
    (tmp_path / "c.yaml").write_text("task:\n  nmae: digits\n", encoding="utf-8")
    code, _, err = cli("train", "c.yaml")
    assert code == 2 and err == "ampguard: error: config: task.nmae: unknown key (did you mean name?)\n"
    (tmp_path / "c.yaml").write_text("log:\n  wandb: maybe\n", encoding="utf-8")
    code, _, err = cli("train", "c.yaml")
    assert code == 2 and err == ("ampguard: error: config: log.wandb: expected true, false, null or a mapping of its "
                                 "settings (got 'maybe')\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_version_names_ampguard_torch_and_python(capsys):
    import platform

    import pytest
    import torch

    from ampguard import __version__
    from ampguard.cli import main

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out == f"ampguard {__version__} (torch {torch.__version__}, Python {platform.python_version()})\n"


def test_version_does_not_import_torch():
    import subprocess
    import sys

    script = ("import sys\nfrom ampguard.cli import main\ntry:\n    main(['--version'])\n"
              "except SystemExit as done:\n    print(done.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "0 False", done.stdout + done.stderr
