"""The library API under torchrun, one file per rank: ``torchrun --nproc_per_node 2 lib_api.py OUT``.

Part 1 (DDP): ``AmpTrainState`` on a DDP-wrapped model, fp16, accumulation 2, init_scale 1024.
Each rank feeds its own batches. Rank 1 only gets a NaN target in the first micro-batch of step
NAN_STEP (mid-group, under ``no_sync``) and an Inf gradient (``inf_grad@INF_STEP@rank1`` through
``ampguard.faults.FaultInjector``) at step INF_STEP. A DDP comm hook counts the gradient
all-reduces (one per closed group is expected, none mid-group).

Part 2 (FSDP2): the model sharded with ``ampguard.distributed.wrap(..., "fsdp2")``, fp32,
accumulation 2, with the injector wired exactly as ``Trainer`` wires it (``attach`` on the
sharded model, ``wrap_loss``, ``wrap_data``) and ``inf_grad@FSDP_INF_STEP@rank1``. Records
whether the sharded gradients stay empty after a mid-group micro-batch (no reduce-scatter).

Part 3 (warnings): a ``Guard`` given scaler settings its fp32 precision ignores, the warnings
recorded: one about the run as a whole, said by rank 0 alone (every rank said it).

Each rank writes ``torch.save(result, f"{OUT}.rank{RANK}.pt")``.
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ampguard import AmpTrainState, Guard
from ampguard import distributed as agd
from ampguard.faults import FaultInjector, parse_fault

STEPS = 6
ACCUM = 2
NAN_STEP = 2
INF_STEP = 4
FSDP_STEPS = 4
FSDP_INF_STEP = 2


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def rank_batches(rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(n)]


def value(x: object) -> float | None:
    return None if x is None else float(x)


def record(log: object) -> dict[str, object]:
    return {
        "step": log.step,
        "skipped": bool(log.skipped),
        "reason": log.reason,
        "scale": value(log.scaler_scale),
        "loss": value(log.loss),
        "pre": value(log.grad_l2_pre_clip),
        "post": value(log.grad_l2_post_clip),
    }


def part_ddp(rank: int) -> dict[str, object]:
    model = make_model()
    ddp = DistributedDataParallel(model)
    allreduces: list[int] = []

    def counting_hook(state, bucket):  # no annotations: DDP checks them (and they would be strings)
        allreduces.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    injector = FaultInjector([parse_fault(f"inf_grad@{INF_STEP}@rank1")], accumulation_steps=ACCUM, rank=rank)
    injector.attach(model)
    state = AmpTrainState(ddp, optimizer, nn.functional.mse_loss, precision="fp16", max_norm=0.5,
                          accumulation_steps=ACCUM, scaler=dict(init_scale=1024.0))
    batches = rank_batches(rank, STEPS * ACCUM)
    if rank == 1:  # NaN target in the first micro-batch of NAN_STEP, on rank 1 only
        x, y = batches[(NAN_STEP - 1) * ACCUM]
        y = y.clone()
        y[0, 0] = float("nan")
        batches[(NAN_STEP - 1) * ACCUM] = (x, y)

    logs, allreduces_per_micro = [], []
    for x, y in injector.wrap_data(batches):
        before = len(allreduces)
        log = state.step(x, y)
        allreduces_per_micro.append(len(allreduces) - before)
        if log is not None:
            logs.append(record(log))
    injector.detach()
    return {
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "scaler": state.scaler.state_dict(),
        "logs": logs,
        "updates": state.updates,
        "steps": state.steps,
        "allreduces_per_micro": allreduces_per_micro,
    }


def part_fsdp2(rank: int) -> dict[str, object]:
    model = agd.wrap(make_model(), "fsdp2", torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    injector = FaultInjector([parse_fault(f"inf_grad@{FSDP_INF_STEP}@rank1")], accumulation_steps=ACCUM, rank=rank)
    injector.attach(model)  # what Trainer does: attach to the (sharded) model
    state = AmpTrainState(model, optimizer, injector.wrap_loss(nn.functional.mse_loss), precision="fp32",
                          max_norm=0.5, accumulation_steps=ACCUM)
    logs, grads_empty_mid_group = [], []
    for x, y in injector.wrap_data(rank_batches(rank, FSDP_STEPS * ACCUM)):
        log = state.step(x, y)
        if log is None:
            grads_empty_mid_group.append(all(p.grad is None for p in model.parameters()))
        else:
            logs.append(record(log))
    injector.detach()
    return {"logs": logs, "grads_empty_mid_group": grads_empty_mid_group}


def part_warnings() -> list[str]:
    model = nn.Linear(2, 1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp32", scaler=dict(init_scale=2.0))
    return [str(w.message) for w in said]


def main() -> None:
    out = sys.argv[1]
    joined = not dist.is_initialized()  # (a helpers.Batch run finds the group of the runs before it)
    if joined:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    constants = dict(STEPS=STEPS, ACCUM=ACCUM, NAN_STEP=NAN_STEP, INF_STEP=INF_STEP, FSDP_STEPS=FSDP_STEPS,
                     FSDP_INF_STEP=FSDP_INF_STEP)
    result = {"rank": rank, "world_size": dist.get_world_size(), "constants": constants, "ddp": part_ddp(rank)}
    result["fsdp2"] = part_fsdp2(rank)
    result["warnings"] = part_warnings()
    torch.save(result, f"{out}.rank{rank}.pt")
    dist.barrier()
    if joined:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
