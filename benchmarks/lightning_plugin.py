"""AmpGuardPlugin against Lightning's own MixedPrecision + gradient_clip_val: time per optimizer step.

Each fits the same MLP on the digits data for ``--steps`` timed steps (after ``WARMUP`` untimed
ones: the fit's set-up is not a step's cost), in ``--rounds`` rounds in one process, each round
fitting every one once in the balanced orders of :func:`ampguard.bench.balanced_orders` (so drift
on a shared machine hits all alike); ``--rounds`` is rounded up to whole cycles of those orders
(6 for the 3 fits) and to at least the 6 rounds a 95% interval needs, with a line saying so.
Prints the median ms per step of each, and its ratio to MixedPrecision: the median of the
per-round ratios with its 95% interval (:func:`ampguard.bench.median_interval`). CPU only here;
``--precision 16-mixed`` is emulated on a CPU (slow). Bad values are refused in one line (exit 2).

    PYTHONPATH=src python benchmarks/lightning_plugin.py --steps 200 --rounds 12
"""

from __future__ import annotations

import statistics
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F

from ampguard.bench import ScriptParser, balanced_orders, in_whole_cycles, least_for_interval, median_interval
from ampguard.integrations.lightning import AmpGuardPlugin
from ampguard.tasks.digits import load_split


class Digits(L.LightningModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


WARMUP = 20
"""Steps of each fit left out of its time: the fit's set-up and the guard's, built at the first
backward, are a fixed cost that a per-step figure of a 200-step fit would spread over its steps."""


class StepClock(L.Callback):
    """The time from the start of step ``WARMUP + 1`` to the end of the fit's last step."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.end: float | None = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if trainer.global_step == WARMUP and self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def fit_seconds(plugin, steps: int, hidden: int, data, **trainer_args) -> float:
    """Seconds of the fit's steps after its first ``WARMUP``."""
    clock = StepClock()
    trainer = L.Trainer(max_steps=steps + WARMUP, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[clock], **trainer_args)
    trainer.fit(Digits(hidden), data)
    return clock.end - clock.start


def main() -> None:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="timed steps a fit (after its first %d)" % WARMUP)
    parser.add_argument("--rounds", type=int, default=12, help="the least; rounded up to whole cycles of the "
                        "orders, and to the 6 a 95%% interval needs")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no OpenMP barriers "
                        "on a shared, oversubscribed CPU)")
    args = parser.parse_args()
    for flag, value in (("--steps", args.steps), ("--rounds", args.rounds), ("--hidden", args.hidden),
                        ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.threads > 4096:
        parser.error(f"--threads must be at most 4096, got {args.threads}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    x, y, _, _ = load_split()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    fits = {
        "lightning MixedPrecision": lambda: fit_seconds(MixedPrecision(args.precision, "cpu"), args.steps, args.hidden,
                                                        data, gradient_clip_val=1.0),
        "AmpGuardPlugin": lambda: fit_seconds(AmpGuardPlugin(args.precision, max_norm=1.0), args.steps, args.hidden,
                                              data),
        "AmpGuardPlugin(log=False)": lambda: fit_seconds(AmpGuardPlugin(args.precision, max_norm=1.0, log=False),
                                                         args.steps, args.hidden, data),
    }
    names = list(fits)
    times: dict[str, list[float]] = {name: [] for name in names}
    orders = balanced_orders(len(names))  # (each fit runs after each other equally often: warm caches even out)
    # whole cycles of the orders (a cut cycle puts some fits first more often), and enough for an interval
    rounds = in_whole_cycles(args.rounds, len(orders), least_for_interval())
    if rounds != args.rounds:
        print(f"  {rounds} rounds, not {args.rounds}: whole cycles of the {len(orders)} orders (each fit in each place "
              f"alike), and at least the {least_for_interval()} a 95% interval needs", flush=True)
    for round_ in range(rounds):
        for i in orders[round_ % len(orders)]:
            times[names[i]].append(fits[names[i]]())
    base = times[names[0]]
    print(f"{args.precision}, MLP hidden {args.hidden}, batch 64, {args.steps} timed steps x {rounds} rounds, "
          f"balanced orders "
          f"(torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads)")
    for name in names:
        ms = [t / args.steps * 1e3 for t in times[name]]
        line = f"  {name:27s} {statistics.median(ms):7.3f} ms/step  (min {min(ms):.3f}, max {max(ms):.3f})"
        if name != names[0]:  # the ratio within each round, then their median: drift between rounds cancels
            med, low, high = median_interval([t / b for t, b in zip(times[name], base)])
            line += f"  x{med:.3f} [{low:.3f}, {high:.3f}] of MixedPrecision (95% interval of the median)"
        print(line)


if __name__ == "__main__":
    main()
