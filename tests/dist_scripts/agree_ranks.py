"""Two gloo ranks (CPU) run ``distributed.agree`` and four guarded steps each, and save what they
saw to ``OUT/rank{0,1}.pt``: ``python agree_ranks.py OUT`` spawns them. tests/unit/test_agree.py's
early job runs its ``_rank`` in two processes forked from a warm one instead (no torch import
each), and checks the results."""

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ampguard import distributed


def _steps(rank: int, sync_free: bool) -> list[tuple]:
    """Four guarded steps on this rank: finite; rank 1's loss NaN; both losses NaN; rank 0's
    gradient inf with finite losses. Each record's (reason, loss_on, console line, JSON line)."""
    import json

    import torch.nn.functional as F

    from ampguard import AmpTrainState, JsonlSink
    from ampguard.sinks import console_line

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if sync_free:
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2), fused=True)
        state = AmpTrainState(model, opt, F.mse_loss, precision="fp32", sync_free=True, lr_schedule=lambda n: n * 0 + 1)
    else:
        state = AmpTrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="fp32")
    inf_grad = []
    model.weight.register_hook(lambda g: g * float("inf") if inf_grad else g)
    x, y = torch.ones(2, 4), torch.zeros(2, 1)
    nan = torch.full((2, 1), float("nan"))
    batches = [(x, y), (x, nan if rank == 1 else y), (x, nan), (x, y)]
    out = []
    for step, (xb, yb) in enumerate(batches, 1):
        if step == 4 and rank == 0:
            inf_grad.append(True)
        record = state.step(xb, yb)
        with tempfile.TemporaryDirectory() as folder:  # (the line as JsonlSink writes it)
            sink = JsonlSink(Path(folder) / "steps.jsonl")
            sink.write(record)
            sink.close()
            lines = (Path(folder) / "steps.jsonl").read_text().splitlines()
        out.append((record.reason, record.loss_on if record.skipped else None, console_line(record),
                    json.loads(lines[0]).get("loss_on")))
    return out


def _replicas(rank: int) -> dict[str, list[tuple[str, str]]]:
    """Three steps of a guard a case, each rank's batches its own: over a model each rank trains
    as its own (``own``), the same with rank 1's first loss NaN (``first_skips``: judged at the
    first finite step) or every first gradient 0 (``first_zero``: nothing to tell by), and over
    it wrapped in DDP (``ddp``); then a GAN (``gan``). The UnsyncedReplicasWarnings each
    case gave: (message, file named)."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from ampguard import AmpTrainState, UnsyncedReplicasWarning

    seen = {}
    for case in ("own", "first_skips", "first_zero", "ddp"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=case != "first_zero")
        guarded = DistributedDataParallel(model) if case == "ddp" else model
        state = AmpTrainState(guarded, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, precision="fp32")
        x, y = torch.full((2, 4), 1.0 + rank), torch.zeros(2, 1)
        nan = torch.full((2, 1), float("nan") if rank == 1 else 0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 4):
                if case == "first_zero" and step == 1:  # (no gradient to tell by: every norm 0)
                    state.step(torch.zeros(2, 4), y)
                else:
                    state.step(x, nan if case == "first_skips" and step == 1 else y)
        seen[case] = [(str(w.message), w.filename) for w in caught if issubclass(w.category, UnsyncedReplicasWarning)]
    # a GAN's two optimizers each stepped on its own, D's model in DDP first, G's left unwrapped: G's first step tells
    from ampguard import Guard

    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    ddp_d = DistributedDataParallel(d)
    guard = Guard([ddp_d, g], {"d": torch.optim.SGD(d.parameters(), lr=0.1),
                               "g": torch.optim.SGD(g.parameters(), lr=0.1)}, precision="fp32")
    x = torch.full((2, 4), 1.0 + rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with guard.autocast():
                loss = F.mse_loss(ddp_d(x), torch.zeros(2, 1))
            guard.backward(loss)
            guard.step("d")
            with guard.autocast():
                loss = g(x).square().mean()
            guard.backward(loss)
            guard.step("g")
    seen["gan"] = [(str(w.message), w.filename) for w in caught if issubclass(w.category, UnsyncedReplicasWarning)]
    # the same two stepped together, by one guard.step(): each judged by its own norm, not their joint one
    torch.manual_seed(0)
    d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
    ddp_d = DistributedDataParallel(d)
    guard = Guard([ddp_d, g], {"d": torch.optim.SGD(d.parameters(), lr=0.1),
                               "g": torch.optim.SGD(g.parameters(), lr=0.1)}, precision="fp32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with guard.autocast():
                loss = F.mse_loss(ddp_d(x), torch.zeros(2, 1)) + g(x).square().mean()
            guard.backward(loss)
            guard.step()
    seen["together"] = [str(w.message) for w in caught if issubclass(w.category, UnsyncedReplicasWarning)]
    return seen


def _refusals(rank: int) -> list[str]:
    """``distributed.refused_on_every_rank`` around rank 0 alone raising, in turn, bad input, a
    full disk's OSError, and nothing: what each rank raised (type and words)."""
    import errno

    from ampguard.errors import InputError

    seen = []
    for error in (InputError("steps.csv already exists"), OSError(errno.ENOSPC, "No space left on device"), None):
        try:
            with distributed.refused_on_every_rank():
                if rank == 0 and error is not None:
                    raise error
        except Exception as err:  # noqa: BLE001 - recorded
            seen.append(f"{type(err).__name__}: {err}")
        else:
            seen.append("none")
    return seen


def _rank(rank: int, out: str) -> None:
    # a file rendezvous, no port: a port found free and then taken by another test's torchrun
    # store (the early jobs run beside) aborted rank 1 ("terminate called without an active exception")
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=2)
    try:
        loss = torch.tensor([0.5, 1.5][rank])
        norms = [
            torch.tensor([1e39, 1.0][rank], dtype=torch.float64),  # finite in float64 on rank 0 only
            torch.tensor([2.0, float("inf")][rank]),  # inf on rank 1 only
            torch.tensor(0.1, dtype=torch.float64),  # finite everywhere
        ]
        agreed, origin = distributed.agree(loss, norms)
        results = {"agreed": [t.item() for t in agreed], "origin": origin.tolist(),
                   "exact": _steps(rank, sync_free=False), "sync_free": _steps(rank, sync_free=True),
                   "replicas": _replicas(rank), "refusals": _refusals(rank)}
        torch.save(results, f"{out}/rank{rank}.pt")
        del loss, norms, agreed, origin, results  # (the tensors the collectives made, freed before the group)
        dist.barrier()  # (both done before either tears its pairs down: a rank destroying the group while its
        # peer still used a pair aborted a CI run once in a while, "process 0 terminated with signal SIGABRT")
    finally:
        # (and what still held the group's tensors collected first, as distributed.shutdown does: a gloo
        # thread still dropping one in the interpreter's teardown aborted the process, "terminate called
        # without an active exception"; seen again after the barrier, 1 run in 7 of the session's CI)
        import gc

        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":  # (spawn imports this file again in each rank)
    mp.spawn(_rank, args=(sys.argv[1],), nprocs=2, join=True)
