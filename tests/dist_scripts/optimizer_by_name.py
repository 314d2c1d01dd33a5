"""A DDP (or one-process) run's optimizer state, keyed by parameter position, loaded into an
FSDP2-sharded model through ``OptimizerState(fsdp=True)`` (a resume that switches
``distributed.strategy`` from ddp to fsdp2). One process, gloo; prints ``ok`` when every moment
and step count arrived, or what did not."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> int:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # (no port to race for)
    from torch.distributed.fsdp import fully_shard

    from ampguard.checkpointer import MODEL, OPTIMIZER, CheckpointManager, Loaded, ModelState, OptimizerState

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    opt = torch.optim.AdamW(plain.parameters(), lr=0.1)
    for _ in range(2):
        plain(torch.randn(2, 4)).sum().backward()
        opt.step()
    saved_model, saved_opt = ModelState(plain).state_dict(), OptimizerState(plain, opt).state_dict()
    assert all(isinstance(k, int) for k in saved_opt["state"])

    sharded = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
    fully_shard(sharded[0])
    fully_shard(sharded[2])
    fully_shard(sharded)
    opt2 = torch.optim.AdamW(sharded.parameters(), lr=0.1)
    parts = {MODEL: ModelState(sharded, True), OPTIMIZER: OptimizerState(sharded, opt2, True)}
    CheckpointManager(None, parts, keep=1).restore(Loaded(Path("step-00000002.pt"),
                                                          {MODEL: saved_model, OPTIMIZER: saved_opt}))
    full = OptimizerState(sharded, opt2, True).state_dict()
    names = [name for name, _ in plain.named_parameters()]
    bad = [f"{name}.{key}" for i, name in enumerate(names) for key in ("exp_avg", "exp_avg_sq", "step")
           if not torch.equal(torch.as_tensor(full["state"][name][key]).cpu(), torch.as_tensor(saved_opt["state"][i][key]))]
    dist.destroy_process_group()
    print("ok" if not bad else "differ: " + ", ".join(bad))
    return 0 if not bad else 1


if __name__ == "__main__":  # (pytest imports this file for doctests: nothing runs then)
    sys.exit(main())
