"""``distributed.agree`` on two real gloo ranks (CPU, spawned processes): one rank's non-finite
value becomes every rank's, whatever the norm's dtype; a value finite everywhere comes back bit
for bit."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampguard import distributed

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        loss = torch.tensor([0.5, 1.5][rank])
        norms = [
            torch.tensor([1e39, 1.0][rank], dtype=torch.float64),  # finite in float64 on rank 0 only
            torch.tensor([2.0, float("inf")][rank]),  # inf on rank 1 only
            torch.tensor(0.1, dtype=torch.float64),  # finite everywhere
        ]
        agreed = distributed.agree(loss, norms)
        torch.save([t.item() for t in agreed], f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_one_ranks_non_finite_value_is_every_ranks(tmp_path):
    mp.spawn(_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    loss0, big0, inf0, same0 = torch.load(tmp_path / "rank0.pt")
    loss1, big1, inf1, same1 = torch.load(tmp_path / "rank1.pt")
    assert loss0 == loss1 == 1.0  # the mean over ranks
    # a float64 norm beyond float32's range is finite: both ranks keep it finite (no rank skips alone)
    assert big0 == 1e39 and big1 == 1.0
    # rank 1's inf: inf where it was, NaN on rank 0 (finite there): both read non-finite
    assert inf1 == float("inf") and inf0 != inf0
    assert same0 == same1 == 0.1  # finite everywhere: unchanged, bit for bit
