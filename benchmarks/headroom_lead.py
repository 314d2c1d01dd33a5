"""How early the headroom alert warns (review 61f): replay the alert rule of ampguard.headroom on an every=1 run's rows for other `every` / `alert_bits`
(the probe does not change the numbers: the rows at a measured step are the same whatever `every`)."""
import csv, math, sys
from collections import defaultdict
from pathlib import Path
import torch
from ampguard.headroom import Headroom, read_headroom_csv, UNSCALED

def load(run):
    run = Path(run)
    steps = list(csv.DictReader(open(run / "steps.csv")))
    rows = defaultdict(list)
    for r in read_headroom_csv(run / "headroom.csv"):
        rows[r.step].append(r)
    return steps, rows

def first_overflow(steps, rows):
    """the first skip after the scaler's opening search (skips before two applied steps in a row)
    where a forward tensor is inf, or from which >= 3 of 4 steps skip (the run is failing)"""
    sk = [s["skipped"] == "1" for s in steps]
    start = next((i for i in range(1, len(sk)) if not sk[i] and not sk[i - 1]), len(sk))
    for i in range(start, len(sk)):
        if not sk[i]:
            continue
        st = i + 1
        fwd = [r for r in rows.get(st, []) if r.tensor in UNSCALED and r.headroom_bits == -math.inf]
        if fwd or sum(sk[i:i + 4]) >= 3:
            where = ",".join(f"{r.module}.{r.tensor}" for r in fwd) or "grads(" + ",".join(sorted({r.module for r in rows.get(st, []) if r.headroom_bits == -math.inf})) + ")"
            return st, where
    return None, None

def replay(steps, rows, every, alert_bits, floor=1.0):
    h = Headroom(torch.nn.Linear(1, 1), "fp16", every=every, alert_bits=alert_bits, loss_scale=lambda: 1.0, scale_floor=floor)
    scale = {int(s["step"]): float(s["scaler_scale"]) for s in steps}
    # the scale a step's backward used is the scale before its update: the previous row's
    used = {st: scale.get(st - 1, 65536.0) for st in scale}
    alerts = []
    for st in sorted(rows):
        if st % every:
            continue
        h._rows, h._row_scale = (st, rows[st]), used[st]
        h._step = st
        for e in h.observe_step(st):
            if e.kind == "headroom_alert":
                alerts.append((st, e.data["module"], e.data["tensor"], round(e.data["judged_bits"], 2)))
    return alerts

if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "headroom.csv").is_file():
        print("usage: headroom_lead.py RUN_DIR (a run folder of `monitor.headroom.every: 1`, with its headroom.csv)", file=sys.stderr)
        sys.exit(2)
    run = sys.argv[1]
    steps, rows = load(run)
    fo, where = first_overflow(steps, rows)
    print(f"run {run}: first overflow skip {fo} ({where}); skips {sum(s['skipped']=='1' for s in steps)}")
    for every in (1, 5, 20, 100):
        for ab in (2.0, 4.0, 6.0):
            a = replay(steps, rows, every, ab)
            before = [x for x in a if fo is None or x[0] <= fo]
            first = before[0] if before else (a[0] if a else None)
            lead = (fo - first[0]) if (first and fo) else None
            per = f"{lead / every:.1f}" if lead is not None else "-"
            print(f"  every {every:3d} alert_bits {ab:g}: alerts {len(a):2d} first {first} lead {lead} steps = {per} periods")
