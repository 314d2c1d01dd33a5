"""review 54e: what the package declares (pyproject.toml's floors) must hold for what the code
uses.

torch>=2.4: what torch 2.4/2.5 lack must not be imported unguarded. FSDP2's ``fully_shard`` became public in ``torch.distributed.fsdp`` in 2.6; 2.4 and 2.5
have it only at ``torch.distributed._composable.fsdp``. The installed torch has both (the second
a re-export of the first): the public name is taken away here for one test once the private
module has bound it, which is the layout torch 2.4/2.5 ship; the function is the real one. The clip's norm fallback is tested in
test_clipping.py."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import GLOO

import ampguard
from ampguard.distributed import is_sharded, wrap

PYPROJECT = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
SOURCES = sorted(Path(ampguard.__file__).parent.rglob("*.py"))


def _floor(spec: str) -> tuple[int, ...]:
    found = re.search(r">=\s*([\d.]+)", spec)
    assert found, spec
    return tuple(int(part) for part in found.group(1).split("."))


@pytest.fixture
def group(tmp_path):
    """A gloo process group of one rank in this process (its store a file)."""
    if not GLOO:
        pytest.skip("needs gloo")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("public", [True, False])
def test_fsdp2_wraps_with_fully_shard_where_torch_2_4_keeps_it(group, monkeypatch, public):
    importlib.import_module("torch.distributed._composable.fsdp")  # (torch 2.4/2.5's place; later a re-export, bound now)
    fsdp = importlib.import_module("torch.distributed.fsdp")

    if not public:  # torch 2.4/2.5: no torch.distributed.fsdp.fully_shard
        monkeypatch.delattr(fsdp, "fully_shard")
    torch.manual_seed(0)
    model = wrap(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)), "fsdp2", torch.device("cpu"))
    assert is_sharded(model) and all(is_sharded(m) for m in (model[0], model[2]))
    model(torch.randn(8, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_python_floor_has_the_grammar_and_the_exception_notes_the_code_uses():
    """requires-python said >=3.10, but the error paths call BaseException.add_note (3.11, PEP 678):
    on 3.10 an error in a guarded backward (an OOM, a KeyboardInterrupt) became an AttributeError."""
    floor = _floor(PYPROJECT["project"]["requires-python"])
    notes = []
    for path in SOURCES:  # (each tree dropped once read: not kept, for the GC to walk)
        source = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source, feature_version=floor[:2])
        if "add_note" in source:  # (an attribute named so is spelled so in the text: the others' trees not walked)
            notes += [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr == "add_note"]
    assert not notes or floor >= (3, 11), (floor, notes)


def test_the_wandb_extra_is_the_floor_the_sink_needs_and_an_older_wandb_is_refused_by_its_version():
    """The extra said wandb>=0.16, but the sink's own run needs reinit="create_new" (0.19.10) and the
    public wandb.teardown (0.21): an older wandb failed to start the run with W&B's own Settings
    errors, which name no version. The extra is WANDB_FLOOR now, and older versions are refused
    up front, in one line naming both."""
    from ampguard.integrations import trackers

    extra = PYPROJECT["project"]["optional-dependencies"]["wandb"]
    assert extra == [f"wandb>={trackers.WANDB_FLOOR}"]
    assert _floor(extra[0]) >= (0, 21)
    assert [trackers.wandb_too_old(v) for v in ("0.16.0", "0.19.9", "0.19.10", "0.20.1")] == [True] * 4
    assert not trackers.wandb_too_old("0.21.0")
    wandb = pytest.importorskip("wandb")
    assert not trackers.wandb_too_old(wandb.__version__) and callable(wandb.teardown)
