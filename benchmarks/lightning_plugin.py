"""AmpGuardPlugin against Lightning's own MixedPrecision + gradient_clip_val: time per optimizer step.

Each fits the same MLP on the digits data for ``--steps`` steps, alternating in ``--rounds``
rounds in one process (so drift on a shared machine hits both); prints the median ms per step
of each and the ratio. CPU only here; ``--precision 16-mixed`` is emulated on a CPU (slow).

    PYTHONPATH=src python benchmarks/lightning_plugin.py --steps 200 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F

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


def fit_seconds(plugin, steps: int, hidden: int, data, **trainer_args) -> float:
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        **trainer_args)
    start = time.perf_counter()
    trainer.fit(Digits(hidden), data)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--precision", default="bf16-mixed", choices=["bf16-mixed", "16-mixed"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: no OpenMP barriers "
                        "on a shared, oversubscribed CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    x, y, _, _ = load_split()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    times: dict[str, list[float]] = {"lightning MixedPrecision": [], "AmpGuardPlugin": [],
                                     "AmpGuardPlugin(log=False)": []}
    for _ in range(args.rounds):
        times["lightning MixedPrecision"].append(fit_seconds(
            MixedPrecision(args.precision, "cpu"), args.steps, args.hidden, data, gradient_clip_val=1.0))
        times["AmpGuardPlugin"].append(fit_seconds(
            AmpGuardPlugin(args.precision, max_norm=1.0), args.steps, args.hidden, data))
        times["AmpGuardPlugin(log=False)"].append(fit_seconds(
            AmpGuardPlugin(args.precision, max_norm=1.0, log=False), args.steps, args.hidden, data))
    medians = {name: statistics.median(t) / args.steps * 1e3 for name, t in times.items()}
    print(f"{args.precision}, MLP hidden {args.hidden}, batch 64, {args.steps} steps x {args.rounds} rounds "
          f"(torch {torch.__version__}, lightning {L.__version__}, {torch.get_num_threads()} threads)")
    for name, ms in medians.items():
        spread = [s / args.steps * 1e3 for s in times[name]]
        print(f"  {name:27s} {ms:7.3f} ms/step  (min {min(spread):.3f}, max {max(spread):.3f})")
    print(f"  ratio AmpGuardPlugin / MixedPrecision: {medians['AmpGuardPlugin'] / medians['lightning MixedPrecision']:.3f}")


if __name__ == "__main__":
    main()
