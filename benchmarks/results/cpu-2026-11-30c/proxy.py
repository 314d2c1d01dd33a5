import sys, torch, torch.nn as nn, torch.nn.functional as F
from ampguard import bench
from ampguard.precision import Precision
torch.set_num_threads(1)
dev = torch.device("cpu")
g = torch.Generator().manual_seed(0)
x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
w = bench.Workload("nano-mlp", make, (x, y), F.cross_entropy)
fused = "fused" in sys.argv
rs = bench.measure(w, Precision(sys.argv[1], "cpu"), dev, [bench.Bare, bench.BareAgain, bench.Guarded, bench.GuardedSyncFree],
                   steps=30, rounds=10, warmup=20, fused=fused, resolve=0.01, budget_s=40)
print(bench.table(rs))
