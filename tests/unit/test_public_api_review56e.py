"""Review 56e, the public API as a typed library: the package shipped no ``py.typed`` (mypy skipped
it as untyped), ``from ampguard import Guard`` was ``Any`` to every checker (the lazy ``__getattr__``),
Guard's set-once attributes read as ``_SetOnce``, ``scaler=`` refused a plain ``GradScaler``, the
sinks' ``extra`` took numbers only, ``AmpTrainState``/``make_guard`` keywords were ``Any``, and
``dir()``/``help()``/star-imports showed helpers. What a checker reads is checked here in-process
(the source's AST, ``inspect``, ``typing.get_type_hints``); no checker runs."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path

import numpy
import torch

import ampguard
from ampguard import sinks
from ampguard.integrations import trackers
from ampguard.integrations.accelerate import make_guard
from ampguard.precision import GuardedGradScaler, Precision, PrecisionName
from ampguard.step import AmpTrainState, Guard, GuardSettings, Models, _SetOnce

PACKAGE = Path(ampguard.__file__).parent
REPO = Path(__file__).resolve().parents[2]


def _module_ast(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def test_the_package_ships_py_typed_and_the_wheel_lists_it():
    assert (PACKAGE / "py.typed").is_file()  # (the editable install reads src/ampguard itself)
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["ampguard"]


def test_the_type_checking_imports_name_each_lazy_export_from_its_module():
    tree = _module_ast(PACKAGE / "__init__.py")
    blocks = [node for node in tree.body if isinstance(node, ast.If)
              and (getattr(node.test, "attr", None) or getattr(node.test, "id", None)) == "TYPE_CHECKING"]
    assert len(blocks) == 1
    typed = {}
    for node in blocks[0].body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, ast.unparse(node)  # (the "as" form: a re-export, PEP 484)
            typed[alias.name] = node.module
    assert typed == ampguard._WHERE


def test___all___is_a_literal_list_of_the_lazy_tables_names():
    tree = _module_ast(PACKAGE / "__init__.py")
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["__all__"]]
    assert isinstance(value, ast.List)  # (pyright refused sorted(_WHERE): reportUnsupportedDunderAll)
    assert ast.literal_eval(value) == sorted(ampguard._WHERE) == ampguard.__all__


def test_importing_ampguard_imports_none_of_its_names():
    """The typed imports are for checkers only: ``import ampguard`` still loads no submodule, no torch."""
    code = ("import importlib, json, sys, typing; before = set(sys.modules); import ampguard; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(PACKAGE.parent), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.stdout.strip() == '["ampguard"]'


def test_dir_shows_the_public_names_not_the_modules_helpers():
    shown = [name for name in dir(ampguard) if not name.startswith("_") and name not in ampguard.__all__
             and not isinstance(getattr(ampguard, name), types.ModuleType)]  # (a submodule once imported)
    assert shown == []  # (was Any, annotations, import_module)
    assert set(ampguard.__all__) <= set(dir(ampguard))


def test_guards_set_once_attributes_have_their_types_for_checkers_and_are_plain_reads():
    hints = typing.get_type_hints(Guard)
    held = {name: hints[name] for name, value in vars(Guard).items() if isinstance(value, _SetOnce)}
    optimizer = torch.optim.Optimizer
    assert held == {
        "optimizer": _SetOnce[optimizer | Mapping[str, optimizer]],
        "optimizers": _SetOnce[Mapping[str, optimizer]],
        "scheduler": _SetOnce[typing.Any],
        "model": _SetOnce[Models],
        "precision": _SetOnce[Precision],
        "scaler": _SetOnce[GuardedGradScaler],
        "device": _SetOnce[torch.device],
    }
    assert not hasattr(_SetOnce, "__get__")  # (the checker's __get__ only: a read stays a __dict__ read)
    model = torch.nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    for name in ("optimizer", "precision", "scaler", "device"):
        [kind] = typing.get_args(held[name])
        assert isinstance(getattr(guard, name), typing.get_args(kind)[0] if name == "optimizer" else kind), name


def test_scaler_is_typed_to_take_a_plain_grad_scaler_as_documented():
    hint = typing.get_type_hints(Guard.__init__)["scaler"]
    assert torch.amp.GradScaler in typing.get_args(hint)  # (GuardedGradScaler only: a plain one was an error)
    model = torch.nn.Linear(2, 1)
    guard = Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                  scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    assert guard.scaler.get_scale() == 1024.0


def test_guard_settings_are_guards_keywords_with_their_types():
    keywords = {name: hint for name, hint in typing.get_type_hints(Guard.__init__).items()
                if name not in ("model", "optimizer", "return")}
    assert typing.get_type_hints(GuardSettings) == keywords
    assert GuardSettings.__required_keys__ == frozenset()
    for passes_them_on in (AmpTrainState.__init__, make_guard):
        assert typing.get_type_hints(passes_them_on)["settings"] == typing.Unpack[GuardSettings]
    # (the run time is unchanged: a misspelt keyword still raises, and help() still lists Guard's)
    assert list(inspect.signature(AmpTrainState.__init__).parameters)[4:] == list(keywords)


def test_each_sinks_extra_takes_what_the_sinks_write():
    """A number, text, a one-element tensor, a NumPy number, None (README), in each sink; the protocol
    takes any mapping (a sink of one's own typed as it was, numbers only, is still one: review 56m);
    at run time the alias is Any, so typing.get_type_hints reads every sink (it named torch unimported)."""
    for_checkers = [node.value.value for node in ast.walk(_module_ast(PACKAGE / "sinks.py"))
                    if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ExtraValue"
                    and isinstance(node.value, ast.Constant)]
    assert len(for_checkers) == 1, for_checkers
    members = set(typing.get_args(eval(for_checkers[0], {"torch": torch, "numpy": numpy})))
    assert members == {float, str, torch.Tensor, numpy.generic, type(None)}
    assert sinks.ExtraValue is typing.Any
    for cls in (sinks.Sink, sinks.CsvSink, sinks.BackgroundSink, trackers.MLflowSink):
        assert typing.get_type_hints(cls.write)["extra"] == typing.Optional[Mapping[str, typing.Any]]
    writers = [sinks.csv_row, trackers.step_metrics]
    for module in (sinks, trackers):
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                writers += [f for name, f in vars(cls).items() if name in ("write", "check") and callable(f)]
    annotations = {f.__qualname__: inspect.signature(f).parameters["extra"].annotation for f in writers
                   if "extra" in inspect.signature(f).parameters}
    assert {"Sink.write", "CsvSink.write", "JsonlSink.write", "BackgroundSink.write", "MLflowSink.write"} <= set(annotations)
    assert annotations.pop("Sink.write") == "Mapping[str, Any] | None"
    assert {name: a for name, a in annotations.items() if a != "Mapping[str, ExtraValue] | None"} == {}


def test_the_guarded_trainers_callback_is_declared_and_its_settings_are_literals():
    tree = _module_ast(PACKAGE / "integrations" / "transformers.py")
    [cls] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "GuardedTrainer"]
    [init] = [node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    declared = {ast.unparse(n.target): ast.unparse(n.annotation) for n in ast.walk(init) if isinstance(n, ast.AnnAssign)}
    assert declared.get("self.ampguard") == "AmpGuardCallback"  # (was AmpGuardCallback | None to pyright)
    given = {a.arg: ast.unparse(a.annotation) for a in init.args.kwonlyargs}
    assert (given["scheduler_on_skip"], given["frozen"]) == ("SchedulerOnSkip", "Frozen")


def test_each_integration_module_exports_its_public_names_only():
    expected = {"lightning": ["AmpGuardPlugin"], "transformers": ["AmpGuardCallback", "GuardedTrainer", "WatchOnlyWarning"],
                "accelerate": ["GuardState", "found_inf", "make_guard"],
                "trackers": ["ForkedRunWarning", "MLflowSink", "TrackerLostWarning", "WandbSink"]}
    for name, names in expected.items():
        tree = _module_ast(PACKAGE / "integrations" / f"{name}.py")
        [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
                   and [getattr(t, "id", None) for t in node.targets] == ["__all__"]]
        defined = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
        assert ast.literal_eval(value) == names and set(names) <= defined, name


def test_help_shows_the_no_batch_default_and_guards_precisions():
    default = inspect.signature(AmpTrainState.step).parameters["inputs"].default
    assert repr(default) == "<no batch>"  # (was <object object at 0x...>)
    precision_arg = Guard.__doc__.split("precision:")[1].split("max_norm:")[0]
    assert [name for name in typing.get_args(PrecisionName) if f'``"{name}"``' not in precision_arg] == []  # (fp8)


def test_the_docs_never_hand_a_step_that_may_be_none_to_a_sink():
    """``step()`` is ``None`` inside an accumulation group: ``write(guard.step(...))`` is a checker's error."""
    for path in (REPO / "README.md", *sorted((REPO / "examples").glob("*.py"))):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"\.write\(\s*\w+\.step\(", text), path.name
