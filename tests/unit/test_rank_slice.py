"""``distributed.rank_slice``: this rank's share of a global batch; 0-dim tensors and non-tensor
leaves are kept whole (a scalar has no batch dimension to split)."""

from __future__ import annotations

import pytest
import torch

from ampguard.distributed import DistInfo, rank_slice
from ampguard.errors import InputError


@pytest.mark.parametrize("rank", [0, 1])
def test_a_0_dim_tensor_is_kept_whole_while_the_batch_is_sliced(rank):
    temp = torch.tensor(0.5)
    batch = {"x": torch.arange(8.0).reshape(4, 2), "temp": temp, "name": "b"}
    part = rank_slice(batch, DistInfo(rank=rank, world_size=2))
    assert part["x"].tolist() == batch["x"][2 * rank : 2 * rank + 2].tolist()
    assert part["temp"] is temp
    assert part["name"] == "b"


def test_a_0_dim_tensor_alone_or_nested_is_kept_whole():
    info = DistInfo(rank=1, world_size=2)
    scalar = torch.tensor(3)
    assert rank_slice(scalar, info) is scalar
    x, (t, y) = rank_slice((torch.arange(4), (scalar, torch.arange(6).reshape(2, 3))), info)
    assert x.tolist() == [2, 3]
    assert t is scalar
    assert y.tolist() == [[3, 4, 5]]


def test_an_uneven_batch_is_still_refused_with_a_0_dim_tensor_beside_it():
    with pytest.raises(InputError, match="a batch of 3 examples does not split evenly over 2 ranks"):
        rank_slice({"x": torch.zeros(3, 2), "temp": torch.tensor(1.0)}, DistInfo(rank=0, world_size=2))


def test_a_world_of_one_keeps_everything():
    batch = {"x": torch.zeros(3, 2), "temp": torch.tensor(1.0)}
    part = rank_slice(batch, DistInfo())
    assert part["x"].shape == (3, 2)
    assert part["temp"] is batch["temp"]
