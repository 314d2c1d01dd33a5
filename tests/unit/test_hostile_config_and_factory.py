"""review_fuzz11's bad inputs: explicit YAML tags a value cannot take, a factory's long or
multi-line exception, a number as the whole config, a NUL in a path setting, and a config or
factory path that exists but is no regular file. Each is one ``ampguard: error:`` line, exit 2,
nothing written."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from helpers import one_error_line

from ampguard.config import load_config
from ampguard.errors import ConfigError

RUN = ("--set", "task.name=linear", "--set", "steps=2", "--set", "precision=fp32", "--set", "log.plot=false")
"""A run of a few seconds, were it let through."""


def _refused(cli, *argv: object) -> str:
    """The one error line of ``ampguard ARGV`` in a working folder left as it was (no run folder)."""
    before = sorted(p.name for p in Path.cwd().iterdir())
    line = one_error_line(cli(*argv))
    assert "\0" not in line
    assert sorted(p.name for p in Path.cwd().iterdir()) == before  # (names only: a FIFO is not read)
    return line


# ---------------------------------------------------------------------------- 1. explicit tags


@pytest.mark.parametrize("text, said", [
    ("optimizer: !!map [1, 2]\n", "!!map takes a mapping, not a sequence (line 1)"),
    ("task:\n  options:\n    x: !!set [1]\n", "!!set takes a mapping, not a sequence (line 3)"),
    ("optimizer: !!map 3\n", "!!map takes a mapping, not a scalar (line 1)"),
    ("log:\n  plot: !!bool maybe\n", "!!bool takes true or false, not 'maybe' (line 2)"),
    ("steps: !!timestamp soon\n", "!!timestamp takes a date, not 'soon' (line 1)"),
])
def test_a_tag_the_value_cannot_take_in_a_config_file_is_one_line(cli, tmp_path, text, said):
    # (was a TypeError, KeyError or AttributeError traceback, exit 1: PyYAML checked the node's
    # kind after our construct_mapping had walked it, and looked the bool word up in a dict)
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    assert _refused(cli, "train", "c.yaml", *RUN) == f"ampguard: error: config file c.yaml: cannot parse: {said}"
    with pytest.raises(ConfigError, match="^config file .*c.yaml: cannot parse: "):
        load_config(tmp_path / "c.yaml")


@pytest.mark.parametrize("item, key", [
    ("optimizer=!!map [1, 2]", "optimizer"),
    ("task.options.x=!!set [1]", "task.options.x"),
    ("log.plot=!!bool maybe", "log.plot"),
])
def test_a_tag_the_value_cannot_take_in_a_set_value_is_one_line(cli, item, key):
    raw = item.partition("=")[2]
    assert _refused(cli, "train", *RUN, "--set", item) == f"ampguard: error: --set {key}: cannot parse value {raw!r}"


def test_an_explicit_bool_still_takes_the_words_a_boolean_setting_takes(tmp_path):
    (tmp_path / "c.yaml").write_text("log: {plot: !!bool off, jsonl: !!bool True}\noptimizer: !!map {lr: 0.5}\n",
                                     encoding="utf-8")
    config = load_config(tmp_path / "c.yaml", ["log.tensorboard=!!bool yes"])
    assert (config.log.plot, config.log.jsonl, config.log.tensorboard, config.optimizer.lr) == (False, True, True, 0.5)


def test_a_runs_own_config_yaml_with_a_tag_it_cannot_take_is_one_line(cli, tmp_path, snapshot):
    code, _, err = cli("train", *RUN, "--set", "log.name=run")
    assert code == 0, err
    config = tmp_path / "runs" / "run" / "config.yaml"
    lines = config.read_text(encoding="utf-8").splitlines(keepends=True)
    at = lines.index("optimizer:\n")
    lines[at: at + 1] = ["optimizer: !!map [1, 2]\n", "x:\n"]  # (x: holds what optimizer held)
    config.write_text("".join(lines), encoding="utf-8")
    said = (f"ampguard: error: config file {Path('runs', 'run', 'config.yaml')}: cannot parse: "
            f"!!map takes a mapping, not a sequence (line {at + 1})")
    before = snapshot(tmp_path)
    assert _refused(cli, "report", "runs/run", "--no-plot") == said
    assert _refused(cli, "train", "--resume", "runs/run", "--set", "steps=4") == said
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------- 5. a factory's exception

FACTORY = """\
import sys
import torch

def state_dict(config):
    torch.nn.Linear(4, 2).load_state_dict({"bogus": torch.zeros(1)})

def long(config):
    raise ValueError("x" * 5000)

def generator_exit(config):
    raise GeneratorExit("closed\\nearly")

def data(config):
    def batches():
        raise ValueError("no data\\ntoday")
        yield
    return torch.nn.Linear(2, 1), batches, torch.nn.functional.mse_loss

def ctrl_c(config):  # a Ctrl-C inside a class body Python runs: it comes out as a RuntimeError caused by it
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as err:
        raise RuntimeError("Error calling __set_name__ on 'Field' instance") from err

class Fails(torch.nn.Linear):  # the first-batch check's three calls into the user's code
    def __init__(self, where):
        super().__init__(2, 1)
        self.where = where
    def forward(self, x):
        if self.where == "forward":
            ctrl_c(None)
        return super().forward(x)
    def loss(self, out, y):
        if self.where == "loss":
            ctrl_c(None)
        return torch.nn.functional.mse_loss(out, y)
    def batches(self):
        if self.where == "data":
            ctrl_c(None)
        while True:
            yield torch.randn(4, 2), torch.randn(4, 1)

def ctrl_c_in(config):
    model = Fails(config.task.options["where"])
    return model, model.batches, model.loss

def ctrl_c_at_batch_5(config):  # past the first-batch check (it reads four): in the run itself
    def batches():
        for i in range(100):
            if i == 5:
                ctrl_c(None)
            yield torch.randn(4, 2), torch.randn(4, 1)
    return torch.nn.Linear(2, 1), batches, torch.nn.functional.mse_loss
"""


@pytest.mark.parametrize("spec, said", [
    ("fac.py:state_dict", "task.factory fac.py:state_dict raised RuntimeError: "
                          "Error(s) in loading state_dict for Linear:"),
    # (cut to 200 characters: the head and the last third, around "...")
    ("fac.py:long", "task.factory fac.py:long raised ValueError: " + "x" * 120 + "..." + "x" * 65),
    ("fac.py:generator_exit", "task.factory fac.py:generator_exit raised GeneratorExit: closed"),
    ("fac.py:data", "task.factory fac.py:data: reading the data failed: ValueError: no data"),
    ("bad_import.py:build", "task.factory: importing bad_import.py failed: RuntimeError: import"),
    ("sys:exit", "task.factory sys:exit raised SystemExit: a Config"),  # (exit(config): 1.5 KB of repr)
])
def test_what_a_factory_raises_is_one_short_line(cli, tmp_path, spec, said):
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    (tmp_path / "bad_import.py").write_text('raise RuntimeError("import\\nfailed\\nbadly")\n', encoding="utf-8")
    line = _refused(cli, "train", *RUN, "--set", f"task.factory={spec}")
    assert line == f"ampguard: error: {said}"


# ---------------------------------------------------------------------------- 8. a number as the config


@pytest.mark.parametrize("text, kind", [("3\n", "int"), ("1.5\n", "float"), ("[1]\n", "list"), ("x\n", "str")])
def test_a_config_that_is_one_value_names_its_kind_not_the_loaders_class(cli, tmp_path, text, kind):
    (tmp_path / "s.yaml").write_text(text, encoding="utf-8")
    said = f"config file s.yaml: the top level must be a mapping, got {kind}"
    assert _refused(cli, "train", "s.yaml") == f"ampguard: error: {said}"


# ---------------------------------------------------------------------------- 9. NUL in a path; no regular file


@pytest.mark.parametrize("text, key, value", [
    ('log: {dir: "a\\0b"}\n', "log.dir", "'a\\x00b'"),
    ('task: {factory: "a\\0b.py:build"}\n', "task.factory", "'a\\x00b.py:build'"),
    ('validation: {checkpoint: "a\\tb.pt"}\n', "validation.checkpoint", "'a\\tb.pt'"),
    ('log: {wandb: {dir: "a\\x7fb"}}\n', "log.wandb.dir", "'a\\x7fb'"),
    ('log: {dir: "a\\u2028b"}\n', "log.dir", "'a\\u2028b'"),  # (a line separator: Python's splitlines cuts there)
    ('log: {dir: "a\\x85b"}\n', "log.dir", "'a\\x85b'"),  # (NEL, a C1 control)
])
def test_a_control_character_in_a_path_setting_is_refused_naming_the_key(cli, tmp_path, text, key, value):
    # (a NUL reached the OS, "embedded null byte", and stderr as a raw byte)
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    said = f"config: {key}: holds a control character (got {value})"
    assert _refused(cli, "train", "c.yaml", "--set", "steps=2", "--set", "precision=fp32") == f"ampguard: error: {said}"
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "c.yaml")
    assert str(info.value) == said



@pytest.mark.parametrize("escaped, name", [("a\\u2028b", "a\u2028b"), ("a\\x85b", "a\x85b"), ("a\\x1bb", "a\x1bb")])
def test_a_run_name_with_a_line_break_or_control_character_is_refused_as_metric_names_are(tmp_path, escaped, name):
    # log.name took NEL and U+2028, which split the console's and the run card's lines naming the
    # run folder; a metric name with them was refused already
    (tmp_path / "c.yaml").write_text(f'log: {{name: "{escaped}"}}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"log.name: must be a plain folder name (got {name!r})")):
        load_config(tmp_path / "c.yaml")


def test_a_run_name_with_a_no_break_space_is_a_name(tmp_path):
    (tmp_path / "c.yaml").write_text('log: {name: "a\\u00a0b"}\n', encoding="utf-8")
    assert load_config(tmp_path / "c.yaml").log.name == "a\u00a0b"

def _not_regular(tmp_path: Path, kind: str, name: str) -> str:
    """A path (``name`` in ``tmp_path``, relative to it) to something that exists but is no regular file."""
    if kind == "fifo":
        os.mkfifo(tmp_path / name)
    elif kind == "folder":
        (tmp_path / name).mkdir()
    else:
        return os.devnull
    return name


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("kind", ["fifo", "devnull"])
def test_a_config_file_that_is_no_regular_file_says_so_not_not_found(cli, tmp_path, kind):
    path = _not_regular(tmp_path, kind, "p.yaml")
    said = f"ampguard: error: config file {path} is not a regular file; name the config file"
    assert _refused(cli, "train", path) == said


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
@pytest.mark.parametrize("kind, what", [("fifo", "not a regular file"), ("folder", "a folder"),
                                        ("devnull", "not a regular file")])
def test_a_factory_file_that_is_no_regular_file_says_so_not_no_such_file(cli, tmp_path, kind, what):
    path = _not_regular(tmp_path, kind, "fac.py")
    said = (f"ampguard: error: task.factory: {path} is {what}; give a Python file's path: "
            "--set task.factory=PATH:build")
    assert _refused(cli, "train", *RUN, "--set", f"task.factory={path}:build") == said


@pytest.mark.parametrize("options, said", [
    ("{1: a, '1': b}", "key '1' appears twice"),  # both became the key "1": the first was dropped, unsaid
    ("{.nan: 1, .nan: 2}", "key '.nan' appears twice"),  # NaN is never equal to NaN
    ("{010: a, 10: b}", "key '10' appears twice, first as '010'"),  # one number: one dict entry
    ("{1.5: x, 1.50: y}", "key '1.50' appears twice, first as '1.5'"),  # (it named the second spelling only)
])
def test_option_keys_that_become_the_same_key_are_refused_as_a_key_given_twice(cli, options, said):
    line = _refused(cli, "train", *RUN, "--set", f"task.options={options}")
    assert line.startswith("ampguard: error: --set task.options: cannot parse value ") and said in line


def test_a_ctrl_c_python_wrapped_in_the_factory_is_an_interrupt_not_bad_input(cli, tmp_path):
    # (it was "task.factory ... raised RuntimeError: Error calling __set_name__", exit 2)
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    code, out, err = cli("train", *RUN, "--set", "task.factory=fac.py:ctrl_c")
    assert (code, err) == (130, "ampguard: interrupted\n"), err


def test_a_ctrl_c_python_wrapped_in_the_data_mid_run_is_an_interrupt_on_the_card_too(cli, tmp_path):
    # exit 130 already, but the run card said "crashed after step 5: RuntimeError"
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    code, out, err = cli("train", "--set", "task.factory=fac.py:ctrl_c_at_batch_5", "--set", "steps=10",
                         "--set", "precision=fp32", "--set", "log.name=w", "--set", "log.plot=false")
    assert code == 130, err
    card = (tmp_path / "runs" / "w" / "RUN.md").read_text(encoding="utf-8")
    assert "**interrupted (Ctrl-C) after step 5**" in card and "crashed" not in card


@pytest.mark.parametrize("where", ["data", "forward", "loss"])
def test_a_ctrl_c_python_wrapped_in_the_first_batch_check_is_an_interrupt_not_bad_input(cli, tmp_path, where):
    # (build.check_forward caught (Exception, SystemExit): "reading the first batch failed: RuntimeError", exit 2)
    (tmp_path / "fac.py").write_text(FACTORY, encoding="utf-8")
    code, out, err = cli("train", *RUN, "--set", "task.factory=fac.py:ctrl_c_in", "--set", f"task.options.where={where}")
    assert (code, err) == (130, "ampguard: interrupted\n"), err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text, said", [
    ("steps: [1\n", "expected ',' or ']', but got '<stream end>' (line 2, column 1)"),
    ("steps: 3\n  precision: bf16\n", "mapping values are not allowed here (line 2, column 12)"),
])
def test_a_yaml_syntax_error_names_the_line_as_json_and_toml_errors_do(cli, tmp_path, text, said):
    # review_walk14 P8: PyYAML's first line ("while parsing a flow sequence") named neither
    (tmp_path / "c.yaml").write_text(text, encoding="utf-8")
    assert _refused(cli, "train", "c.yaml", *RUN) == f"ampguard: error: config file c.yaml: cannot parse: {said}"


def test_a_factory_key_misspelt_or_a_task_it_returns_with_a_bad_model_is_one_line(tmp_path):
    # review_session26: {"evalute": ...} trained with no evaluation, unsaid; a Task returned as it is
    # skipped every check (a model "notamodel" was a traceback at its first move)
    from ampguard.config import load_config
    from ampguard.errors import InputError
    from ampguard.tasks import build_task

    (tmp_path / "f.py").write_text("""
import torch
from torch import nn
from ampguard.tasks import Task, cycle


def misspelt(config):
    data = [(torch.ones(4, 2), torch.zeros(4, 1))]
    return {"model": nn.Linear(2, 1), "data": data, "loss_fn": nn.functional.mse_loss,
            "evalute": lambda m, d: {"v": 1.0}, "metrics": ["v"]}


def task(config):
    return Task("mine", "notamodel", nn.functional.mse_loss, batches=lambda: cycle(lambda: []))
""", encoding="utf-8")
    for fn, said in (("misspelt", "returned the unknown key 'evalute' (did you mean evaluate?); it takes model, "),
                     ("task", "model is a str, not an nn.Module")):
        with pytest.raises(InputError) as info:
            build_task(load_config(None, [f"task.factory={tmp_path / 'f.py'}:{fn}"]))
        assert said in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------- review 33b: a factory's reach

REACH = """
import os
import torch
from torch import nn


def data():
    for _ in range(8):
        yield torch.randn(4, 2), torch.randn(4, 1)


def pair(config, **more):
    return {"model": nn.Linear(2, 1), "data": data, "loss_fn": nn.functional.mse_loss, **more}


def mutates(config):  # what the config's checks passed already: a run folder outside log.dir, -5 steps
    config.log.name = "../../escaped"
    config.steps = -5
    return pair(config)


def moves(config):
    os.chdir(config.task.options["to"])
    return pair(config)


def loud(config):
    raise ValueError("bad\\x1b[2J value\\x07")


def complex_loss(config):
    return pair(config, loss_fn=lambda out, y: ((out - y) ** 2).mean() * (1 + 1j))


def evaluate_none(config):
    return pair(config, evaluate=lambda model, device: None, metrics=["v"])


def metrics_alone(config):
    return pair(config, metrics=["v"])


def predict_str(config):
    return pair(config, predict="model")
"""


def _reach(tmp_path: Path, fn: str, *more: str):
    from ampguard.tasks import build_task

    (tmp_path / "reach.py").write_text(REACH, encoding="utf-8")
    return build_task(load_config(None, [f"task.factory={tmp_path / 'reach.py'}:{fn}", *more]))


def test_a_factory_gets_a_copy_of_the_config_so_what_it_sets_changes_nothing_of_the_run(tmp_path):
    # (its log.name "../../escaped" wrote the run folder outside log.dir, its steps -5 ended in a
    # ZeroDivisionError: set after the config's checks had passed)
    config = load_config(None, [f"task.factory={tmp_path / 'reach.py'}:mutates"])
    before = config.model_dump()
    (tmp_path / "reach.py").write_text(REACH, encoding="utf-8")
    from ampguard.tasks import build_task

    build_task(config)
    assert config.model_dump() == before


def test_a_factory_that_changes_the_working_folder_is_set_back_with_a_warning(tmp_path, monkeypatch):
    # (the console said "run folder: runs/x" and the files went under the folder build() moved to)
    from ampguard.errors import AmpguardWarning

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.warns(AmpguardWarning, match=r"reach\.py:moves: build\(\) changed the working folder to .*elsewhere; "
                                             r"set back to .*, where the command runs and its run folder goes"):
        _reach(tmp_path, "moves", f"task.options.to={tmp_path / 'elsewhere'}")
    assert Path.cwd() == tmp_path


@pytest.mark.parametrize("fn, said", [
    # its message's escape sequences reached the terminal (the first cleared the screen)
    ("loud", r"task.factory reach.py:loud raised ValueError: bad\x1b[2J value\x07"),
    # the backward dropped the imaginary part, with a UserWarning of torch's
    ("complex_loss", "task.factory reach.py:complex_loss: loss_fn must return a real floating-point tensor; it "
                     "returned torch.complex64"),
    # it "raised AttributeError: 'NoneType' object has no attribute 'items'"
    ("evaluate_none", "task.factory: evaluate() returned a NoneType, not a mapping of metric names to numbers "
                      "({'val_loss': 0.42})"),
    # its columns stayed empty, unsaid
    ("metrics_alone", "task.factory reach.py:metrics_alone: metrics ['v'] is given but no evaluate returns them: "
                      "add evaluate(model, device) -> {name: value}, or drop metrics"),
    ("predict_str", "task.factory reach.py:predict_str: predict must be a function, got a str"),  # (at validate)
])
def test_what_a_factory_gives_that_a_run_cannot_use_is_one_line(cli, tmp_path, fn, said):
    (tmp_path / "reach.py").write_text(REACH, encoding="utf-8")
    assert _refused(cli, "train", *RUN, "--set", f"task.factory=reach.py:{fn}") == f"ampguard: error: {said}"


def test_a_factory_file_imports_a_module_beside_it_and_a_module_factory_is_found_from_the_working_folder(
        tmp_path, monkeypatch):
    # as `python file.py` and `python -m` find them; the `ampguard` script found neither
    import sys

    from ampguard.tasks import build_task

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "beside_33b.py").write_text("WIDTH = 3\n", encoding="utf-8")
    (tmp_path / "lib" / "net.py").write_text(REACH.replace("nn.Linear(2, 1)", "nn.Linear(2, WIDTH)").replace(
        "import os\n", "import os\nfrom beside_33b import WIDTH\n").replace("torch.randn(4, 1)", "torch.randn(4, 3)"),
        encoding="utf-8")
    (tmp_path / "pkg_33b").mkdir()
    (tmp_path / "pkg_33b" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "pkg_33b" / "mod.py").write_text(REACH, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert build_task(load_config(None, ["task.factory=lib/net.py:pair"])).model.out_features == 3
        assert build_task(load_config(None, ["task.factory=pkg_33b.mod:pair"])).model.out_features == 1
    finally:
        for name in [n for n in sys.modules if n.startswith(("beside_33b", "pkg_33b"))]:
            del sys.modules[name]


AGAIN = """
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset


class OneShot(IterableDataset):  # __iter__ returns itself: a second pass goes on where the first stopped
    def __init__(self, n):
        self.left = iter([(torch.randn(2), torch.randn(1)) for _ in range(n)])

    def __iter__(self):
        return self.left


def one_shot(config):  # four batches: the start-up's read took them all
    return nn.Linear(2, 1), DataLoader(OneShot(4), batch_size=None), nn.functional.mse_loss


def one_shot_longer(config):  # its fifth batch came as the first of the second pass: refused too
    return nn.Linear(2, 1), DataLoader(OneShot(8), batch_size=None), nn.functional.mse_loss


def drifting(config):  # a generator of its own, never set back: every pass other batches
    rng = np.random.default_rng(0)

    def data():
        for _ in range(8):
            yield torch.tensor(rng.normal(size=(4, 2)), dtype=torch.float32), torch.zeros(4, 1)
    return nn.Linear(2, 1), data, nn.functional.mse_loss


def drawing(config):  # the global RNG: read again from the same state, the same batches
    def data():
        for _ in range(8):
            yield torch.randn(4, 2), torch.zeros(4, 1)
    return nn.Linear(2, 1), data, nn.functional.mse_loss
"""


def test_data_read_again_from_its_start_must_give_its_first_batch_again(tmp_path):
    # review 33b: a one-shot IterableDataset passed (iter(loader) is not loader) and the run stopped at
    # its fourth step as bad data; data that changes from pass to pass resumed on other batches, unsaid
    import warnings

    import torch

    from ampguard.errors import AmpguardWarning, InputError
    from ampguard.tasks import build_task

    (tmp_path / "again.py").write_text(AGAIN, encoding="utf-8")

    def build(fn):
        return build_task(load_config(None, [f"task.factory={tmp_path / 'again.py'}:{fn}"]))

    with pytest.raises(InputError, match=r"again\.py:one_shot: data yielded no batch when read a second time \(a "
                                         r"one-shot iterable\?\)"):
        build("one_shot")
    with pytest.warns(AmpguardWarning, match=r"again\.py:one_shot_longer: data read again from its start gave "
                                             r"another first batch, and every read shares one iterator"):
        build("one_shot_longer")  # (review 38: warned as a likely one-shot; an iterable that starts over and
        # returns itself shares one iterator too: review 38i)
    with pytest.warns(AmpguardWarning, match=r"again\.py:drifting: data read again from its start gave another "
                                             r"first batch: a resume, a rollback or locate's replay reads other"):
        build("drifting")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AmpguardWarning)
        build("drawing")
    drawn = torch.rand(1)
    torch.manual_seed(0)
    torch.nn.Linear(2, 1)  # (the model's initial weights: the start-up's reads left no trace on the run's draws,
    assert torch.equal(torch.rand(1), drawn)  # review 39e; its first read's four batches did, as the run's first)
