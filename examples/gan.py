"""A GAN under one guard: a generator and a discriminator, two losses, two optimizers, alternating.

The target is a toy 2-D distribution: eight Gaussians on a ring of radius 2. Each iteration steps
the discriminator, then the generator, through the same ``Guard`` (one loss scale, as PyTorch's
GradScaler GAN recipe has). An overflow in one network's backward skips that optimizer alone:

    python examples/gan.py --precision fp16 --iterations 200 --csv gan.csv --inf-at 50

``--inf-at N`` turns the generator's gradient into inf during iteration N's backward (what an
fp16 overflow does); its CSV row says ``skipped_optimizers=generator`` while the discriminator's
row of that iteration is applied, and the loss scale halves once.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F

from ampguard import CsvSink, Guard
from ampguard.errors import InputError


def ring(n: int, generator: torch.Generator, modes: int = 8, radius: float = 2.0) -> torch.Tensor:
    """``n`` points from eight Gaussians (std 0.05) evenly spaced on a circle."""
    angle = torch.randint(0, modes, (n,), generator=generator) * (2 * math.pi / modes)
    centres = torch.stack([angle.cos(), angle.sin()], 1) * radius
    return centres + 0.05 * torch.randn(n, 2, generator=generator)


def ring_distance(points: torch.Tensor, radius: float = 2.0) -> float:
    """How far generated points are from the ring, on average (0 is on it)."""
    return float((points.norm(dim=1) - radius).abs().mean())


def networks(noise: int = 8, width: int = 64) -> tuple[nn.Module, nn.Module]:
    generator = nn.Sequential(nn.Linear(noise, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 2))
    discriminator = nn.Sequential(nn.Linear(2, width), nn.LeakyReLU(0.2), nn.Linear(width, width),
                                  nn.LeakyReLU(0.2), nn.Linear(width, 1))
    return generator, discriminator


def bce(logits: torch.Tensor, target: float) -> torch.Tensor:
    logits = logits.float()
    return F.binary_cross_entropy_with_logits(logits, torch.full_like(logits, target))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gan.py", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--precision", choices=["fp16", "bf16", "fp32"], default="bf16")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--csv", default="gan.csv")
    parser.add_argument("--inf-at", type=int, default=None, help="overflow the generator's gradient in this iteration")
    args = parser.parse_args(argv)
    if min(args.iterations, args.batch) < 1:  # (a batch of 0 trained on NaN losses, every step skipped, exit 0)
        parser.error("--iterations and --batch are whole numbers >= 1")
    if args.inf_at is not None and not 1 <= args.inf_at <= args.iterations:  # (a fault that never fires)
        parser.error(f"--inf-at {args.inf_at} is no iteration of the run (1 to --iterations {args.iterations})")
    try:
        return train(args)
    except InputError as err:  # e.g. the CSV exists already: never overwritten, said in one line
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    """The guarded loop; writes the CSV, prints one line, returns 0."""
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(1)
    generator, discriminator = networks()
    optimizers = {"discriminator": torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
                  "generator": torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))}
    guard = Guard({"generator": generator, "discriminator": discriminator}, optimizers, precision=args.precision,
                  max_norm=5.0, scaler={"init_scale": 1024.0} if args.precision == "fp16" else None)
    probe = torch.randn(512, 8, generator=data)
    with torch.no_grad():
        start = ring_distance(generator(probe))

    sink = CsvSink(args.csv, extra_columns=guard.record_columns)  # + optimizers, skipped_optimizers
    try:
        for iteration in range(1, args.iterations + 1):
            real, z = ring(args.batch, data), torch.randn(args.batch, 8, generator=data)

            with guard.autocast():                                   # the discriminator: real vs fake
                d_loss = bce(discriminator(real), 1.0) + bce(discriminator(generator(z).detach()), 0.0)
            guard.backward(d_loss)
            if (record := guard.step("discriminator")) is not None:  # (None only inside an accumulation group)
                sink.write(record)

            with guard.autocast():                                   # the generator: fool it
                g_loss = bce(discriminator(generator(z)), 1.0)       # (its gradients in D are dropped)
            hook = None
            if iteration == args.inf_at:                             # the fault: an overflow in G's backward
                hook = generator[0].weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
            guard.backward(g_loss)
            if hook is not None:
                hook.remove()
            if (record := guard.step("generator")) is not None:
                sink.write(record)
    finally:
        sink.close()

    with torch.no_grad():
        end = ring_distance(generator(probe))
    applied = guard.applied
    print(f"gan {args.precision}: {guard.steps} steps, applied discriminator {applied['discriminator']} "
          f"generator {applied['generator']}; distance to the ring {start:.2f} -> {end:.2f}; csv {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
