"""ampguard's guarded step inside an Accelerate script: Accelerate places and wraps (DDP), ampguard
does the AMP (``mixed_precision="no"`` for Accelerate), every process skips the same steps.

    accelerate launch --multi_gpu --num_processes 2 --mixed_precision no --main_process_port 0 \\
        examples/accelerate_guard.py --precision bf16 --steps 12 --csv steps.csv --inf-at 5 --inf-rank 1

(``--cpu`` with several processes wants MPI and starts one process: ``--multi_gpu`` starts them,
and the script asks for the CPU when there is no GPU.)

``--inf-at N --inf-rank R`` writes inf into one gradient on process R alone at step N: the guard's
one all-reduce per step (``ampguard.distributed.agree``) makes it a skip on every process, so the
replicas stay identical. Process 0 writes the per-step CSV; each process prints its own line
(``rank R: ... skipped [N] checksum ...``) so you can check they agree.
"""

from __future__ import annotations

import argparse
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ampguard import CsvSink, distributed
from ampguard.errors import InputError
from ampguard.integrations.accelerate import make_guard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accelerate_guard.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--csv", default="steps.csv")
    parser.add_argument("--inf-at", type=int, default=None, help="write inf into a gradient at this step")
    parser.add_argument("--inf-rank", type=int, default=0, help="... on this process only")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps is a whole number >= 1")
    if args.inf_at is not None and not 1 <= args.inf_at <= args.steps:  # (a fault that never fires: a clean run)
        parser.error(f"--inf-at {args.inf_at} is no step of the run (1 to --steps {args.steps})")

    # ampguard does the autocast and the loss scaling; cpu=True: gloo processes where there is no GPU
    accelerator = Accelerator(mixed_precision="no", cpu=not torch.cuda.is_available())
    if args.inf_at is not None and not 0 <= args.inf_rank < accelerator.num_processes:  # (no such process)
        if accelerator.is_main_process:
            print(f"{parser.prog}: error: --inf-rank {args.inf_rank} is no process of the run (0 to "
                  f"{accelerator.num_processes - 1})", file=sys.stderr)
        distributed.shutdown()
        return 2
    try:
        sink = open_csv(accelerator, args.csv)
    except InputError as err:  # e.g. the CSV exists already: never overwritten, said in one line
        if accelerator.is_main_process:
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
        distributed.shutdown()                         # every process stops here, before any step
        return 2
    line = train(accelerator, args, sink)              # the DDP model and the guard live in there only
    sys.stdout.write(line)  # one write: the processes share the pipe, print() would write the newline apart
    sys.stdout.flush()
    accelerator.wait_for_everyone()                    # leave together
    accelerator.free_memory()                          # the accelerator's own references to the DDP model
    # free the DDP model (its reducer) before the process group, then leave it: freed in the
    # interpreter's teardown instead, the reducer can abort the process (exit -6)
    distributed.shutdown()
    return 0


def open_csv(accelerator: Accelerator, path: str) -> CsvSink | None:
    """Process 0's CSV (``None`` on the others), opened before any step. A refusal (the file
    exists) is sent to every process and raised there too: all stop, none waits for the others."""
    sink, refusal = None, [None]
    if accelerator.is_main_process:
        try:
            sink = CsvSink(path)
        except InputError as err:
            refusal = [str(err)]
    broadcast_object_list(refusal)                     # (in place: process 0's message, or None)
    if refusal[0] is not None:
        raise InputError(refusal[0])
    return sink


def train(accelerator: Accelerator, args: argparse.Namespace, sink: CsvSink | None) -> str:
    """The guarded loop, ``sink`` written and closed by process 0; returns this process's line
    (steps, updates, skips, a weights checksum)."""
    torch.manual_seed(0)                               # the same initial weights on every process
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: min(1.0, (update + 1) / 4))
    x = torch.randn(16 * args.steps * accelerator.num_processes, 8)
    data = DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=16)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)   # DDP, each process its shard

    guard = make_guard(accelerator, model, optimizer, precision=args.precision, max_norm=1.0,
                       scheduler=scheduler, scaler={"init_scale": 1024.0} if args.precision == "fp16" else None)
    first = next(model.parameters())
    if args.inf_at is not None and accelerator.process_index == args.inf_rank:
        first.register_hook(lambda g: g.fill_(float("inf")) if guard.steps + 1 == args.inf_at else g)

    skipped = []
    try:
        for step, (inputs, targets) in zip(range(args.steps), data):
            with guard.autocast():
                loss = nn.functional.mse_loss(model(inputs).float(), targets)
            guard.backward(loss)                      # instead of accelerator.backward(loss)
            record = guard.step()                     # instead of clip_grad_norm_ + optimizer.step()
            if record is None:                        # inside an accumulation group
                continue
            if record.skipped:
                skipped.append(record.step)
            if sink is not None:
                sink.write(record)
    finally:
        if sink is not None:
            sink.close()
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    # each layer's output dtype in the first forward: which ones autocast left in float32 (none here)
    dtypes = ", ".join(f"{name} {dtype}" for name, dtype in (guard.autocast_dtypes or {}).items())
    return (f"rank {accelerator.process_index}: {guard.steps} steps, {guard.updates} updates, skipped {skipped} "
            f"checksum {checksum:.10f}; under autocast: {dtypes or 'nothing noted'}\n")


if __name__ == "__main__":
    raise SystemExit(main())
