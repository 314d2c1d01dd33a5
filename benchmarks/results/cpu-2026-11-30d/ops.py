"""Ops per step (bench.ops_per_step) of the nano MLP's contenders, by precision and optimizer."""
import warnings

import torch

from ampguard import bench
from ampguard.precision import Precision

warnings.simplefilter("ignore")
dev = torch.device("cpu")
for precision in ("bf16", "fp16", "fp32"):
    for fused in (False, True):
        counts = []
        for c in [bench.Bare, bench.Guarded] + ([bench.GuardedSyncFree] if fused else []) + bench.available_peers():
            contender = c(bench._WORKLOADS["nano"](dev), Precision(precision, "cpu"), dev, fused)
            for _ in range(3):
                contender.step()
            counts.append(f"{c.name}={bench.ops_per_step(contender)}")
            contender.close()
        print(precision, "fused" if fused else "default", counts)
