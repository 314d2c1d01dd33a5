import torch, warnings
from ampguard import bench
from ampguard.precision import Precision


def rotated_orders(n: int) -> list[list[int]]:
    """A plain rotation (each contender always after the same neighbour): for comparison with
    bench.balanced_orders. (Moved here from ampguard.bench, where nothing else used it.)"""
    return [[(x + shift) % n for x in range(n)] for shift in range(n)]


warnings.simplefilter("ignore")
torch.set_num_threads(1)
dev = torch.device("cpu")
w = bench._WORKLOADS["nano"](dev)
for rep in range(2):
    for name, orders in (("rotated", rotated_orders), ("balanced", bench.balanced_orders)):
        rs = bench.measure(w, Precision("bf16", "cpu"), dev, [bench.Bare, bench.BareAgain, bench.Guarded, bench.GuardedSyncFree],
                           steps=30, rounds=8, warmup=20, fused=True, resolve=0.01, budget_s=25, orders=orders)
        print(name, " ".join(f"{r.contender.replace('ampguard ', '')}={r.ratio_to_bare:.3f}[{r.ratio_low:.3f},{r.ratio_high:.3f}]" for r in rs[1:]), len(rs[0].rounds), flush=True)
