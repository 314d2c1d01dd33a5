"""review 54e: the package says torch>=2.4, so what torch 2.4/2.5 lack must not be imported
unguarded. FSDP2's ``fully_shard`` became public in ``torch.distributed.fsdp`` in 2.6; 2.4 and 2.5
have it only at ``torch.distributed._composable.fsdp``. The installed torch has both (the second
a re-export of the first): the public name is taken away here for one test once the private
module has bound it, which is the layout torch 2.4/2.5 ship; the function is the real one. The clip's norm fallback is tested in
test_clipping.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from helpers import GLOO

from ampguard.distributed import is_sharded, wrap


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
