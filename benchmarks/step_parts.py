"""Where the guard's cost goes on a launch-bound step: the bare loop, the guarded step alone, the
step with its values read, and the step with its CSV row, interleaved in one process.

    python benchmarks/step_parts.py [--device cpu|cuda] [--precision bf16] [--rounds 30]
                                    [--model mlp|transformer]

Prints each part's median microseconds per step and its ratio to the bare loop (bench.py's tiny
MLP: 32-64-64-10 at batch 64, or its small transformer; one thread on a CPU), the ratio also
as the median of each round's ratio with its interquartile range, the rounds in balanced orders
(``--rounds`` rounded up to whole cycles of them, as ``train_vs_bare.py``'s blocks are: 32 for the
default 30, with a line saying so). The interquartile range is the middle half of the rounds'
ratios, a spread, not a confidence interval of the median (``ampguard bench`` gives that one).
A bad ``--precision``, ``--device`` (``cuda`` without a GPU) or count is refused in one line
(exit 2) before anything runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ampguard.bench import (
    Bare, Guarded, ScriptParser, _case_left_out, _mlp, _nano, _transformer, balanced_orders, in_whole_cycles,
)
from ampguard.precision import PRECISIONS, Precision

MEASURED = tuple(p for p in PRECISIONS if p != "fp8")
"""The precisions this script times (fp8 converts the model: ``ampguard bench --precisions fp8``)."""


class StepOnly(Guarded):
    """The guarded step, its record left unread."""

    def step(self) -> None:
        self.state.step(*self.w.batch)


class StepAndValues(Guarded):
    """The guarded step and its record's values read on the host (what every sink starts with)."""

    def step(self) -> None:
        self.state.step(*self.w.batch).values()


def _device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """``--device`` as a device this script can time on (the CPU, or a CUDA GPU that is there), or
    a one-line usage error."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        parser.error(f"--device: expected cpu or cuda (cuda:N), got {name!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device: expected cpu or cuda (cuda:N), got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device: cuda was asked for but no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device: {name} was asked for but there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def main() -> None:
    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="bf16", choices=MEASURED)
    parser.add_argument("--rounds", type=int, default=30, help="the least; rounded up to whole cycles of the orders")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fused", action="store_true", help="fused AdamW for every part (bench's --fused)")
    parser.add_argument("--model", choices=("mlp", "nano", "transformer"), default="mlp")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    device = _device(parser, args.device)
    if why := _case_left_out(args.model, args.precision, device):  # (as ampguard bench: fp16 autocast on a CPU)
        parser.error(f"--precision {args.precision} --model {args.model}: {why}")
    if device.type == "cpu":
        torch.set_num_threads(1)
    precision = Precision(args.precision, device.type)
    workload = {"mlp": lambda: _mlp(device), "nano": lambda: _nano(device),
                "transformer": lambda: _transformer(device, "small")}[args.model]
    parts = {c.__name__: c(workload(), precision, device, args.fused) for c in (Bare, StepOnly, StepAndValues, Guarded)}
    times: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(3 if args.model == "transformer" else 20):
        for part in parts.values():
            part.step()
    order, orders = list(parts.items()), balanced_orders(len(parts))  # each part after every other alike
    # whole cycles of the orders (as train_vs_bare.py's blocks): a cut cycle puts some parts first more often
    rounds = in_whole_cycles(args.rounds, len(orders))
    print(f"step parts, {args.model} {args.precision} on {device}: {rounds} rounds x {args.steps} steps, balanced "
          f"orders of {len(parts)} parts", flush=True)
    if rounds != args.rounds:
        print(f"  {rounds} rounds, not {args.rounds}: whole cycles of the {len(orders)} orders (each part in each "
              "place alike)", flush=True)
    for r in range(rounds):
        for name, part in (order[i] for i in orders[r % len(orders)]):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                part.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append((time.perf_counter() - start) / args.steps)
    bare = statistics.median(times["Bare"])
    labels = {"Bare": "bare loop", "StepOnly": "guarded step", "StepAndValues": "+ values() read",
              "Guarded": "+ CSV row (ampguard + csv)"}
    for name, series in times.items():
        median = statistics.median(series)
        ratios = [t / b for t, b in zip(series, times["Bare"])]
        q1, mid, q3 = statistics.quantiles(ratios, n=4)
        print(f"{labels[name]:<28} {median * 1e6:8.1f} us  x{median / bare:.3f}  "
              f"(per round x{mid:.3f} [{q1:.3f}, {q3:.3f}])")
    for part in parts.values():
        part.close()


if __name__ == "__main__":
    main()
