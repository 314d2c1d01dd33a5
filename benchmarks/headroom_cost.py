"""What headroom telemetry and the skipped-step gradient capture cost, measured.

Part 1 (the issue's goal: within 2%): whole ``ampguard train`` runs of the default config (charlm,
bf16, 1000 steps), without and with ``monitor.headroom.every`` (100 by default), interleaved
A, B, A, B, ... in fresh processes; wall time of each, the medians and the overhead.

Part 2 (robust on a busy machine): in one process on the default charlm model, interleaved in
rounds, ms/step of the bare step, of the step inside the always-on gradient capture of
:class:`ampguard.headroom.SkipGradNorms` (one post-accumulate-grad hook per parameter for the
step's duration, references dropped after an applied step), and of a measured headroom step;
the measured step's extra cost spread over ``--every`` steps is the telemetry's overhead.

Run from the repository root::

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/headroom_cost.py --pairs 2 --every 100 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def train_seconds(log_dir: Path, name: str, extra: list[str], threads: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``ampguard train`` process. CPU time (user + system of
    the child) is what to compare on a machine shared with other work: wall time there measures
    the neighbours as much as the run."""
    cmd = [sys.executable, "-m", "ampguard", "train", "--set", f"log.dir={log_dir}", "--set", f"log.name={name}",
           "--set", "log.every=100000", *extra]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def whole_runs(pairs: int, every: int, steps: int | None, threads: int) -> None:
    steps_arg = ["--set", f"steps={steps}"] if steps else []
    arms = {"off": [], f"every={every}": ["--set", f"monitor.headroom.every={every}"]}
    walls: dict[str, list[float]] = {arm: [] for arm in arms}
    cpus: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for arm, extra in arms.items():
                wall, cpu = train_seconds(Path(tmp), f"{arm}-{i}".replace("=", ""), [*steps_arg, *extra], threads)
                walls[arm].append(wall)
                cpus[arm].append(cpu)
                print(f"run {i + 1} {arm:>10}: wall {wall:7.2f} s, cpu {cpu:7.2f} s", flush=True)
    for what, table in (("wall", walls), ("cpu", cpus)):
        base, with_it = (statistics.median(v) for v in table.values())
        print(f"median {what}: off {base:.2f} s, every={every} {with_it:.2f} s: overhead {100 * (with_it / base - 1):+.2f}%")


def in_process(rounds: int, steps: int, every: int, threads: int) -> None:
    """Per-step cost, one process, the default charlm model and config: the bare step; the step
    inside the gradient capture (what every step of a run pays); and a *measured* headroom step
    (hooks, reductions, the host read, the alerts and the CSV rows), whose cost is then spread
    over ``every`` steps. The arms take turns step by step; each step's CPU time is taken."""
    import torch

    from ampguard.build import build_state
    from ampguard.config import validate
    from ampguard.headroom import Headroom, HeadroomCsv, SkipGradNorms
    from ampguard.tasks import build_task

    torch.set_num_threads(threads)  # steadier on a shared machine
    config = validate({"device": "cpu"})
    torch.manual_seed(0)
    task = build_task(config)
    state = build_state(config, task.model, task.loss_fn, torch.device("cpu"))
    norms = SkipGradNorms(task.model)
    headroom = Headroom(task.model, config.precision, every=1, alert_bits=4.0)
    batches = iter(task.batches())
    with tempfile.TemporaryDirectory() as tmp:
        csv = HeadroomCsv(Path(tmp) / "headroom.csv", headroom)

        def bare() -> None:
            state.step(*next(batches))

        def captured() -> None:
            with norms.capturing():
                record = state.step(*next(batches))
            norms.after(record)

        def measured() -> None:
            step = state.steps + 1
            with norms.capturing(), headroom.measuring(step):
                record = state.step(*next(batches))
            csv.write(record)
            headroom.observe(record)
            norms.after(record)

        def alternate(a, b) -> tuple[float, float]:  # two arms, step by step: medians of CPU ms/step
            a(), b()  # warm-up
            ta, tb = [], []
            for _ in range(rounds * steps):
                for fn, out in ((a, ta), (b, tb)):
                    start = time.process_time()
                    fn()
                    out.append(1000 * (time.process_time() - start))
            return statistics.median(ta), statistics.median(tb)

        base, cap = alternate(bare, captured)
        cap2, meas = alternate(captured, measured)
        csv.close()
    n = rounds * steps
    print(f"bare step {base:.3f} ms vs + gradient capture ({len(norms.params)} parameters) {cap:.3f} ms CPU time: "
          f"{100 * (cap / base - 1):+.2f}% every step (medians of {n} alternating steps, {threads} thread(s))")
    print(f"captured step {cap2:.3f} ms vs measured headroom step ({len(headroom.modules)} modules) {meas:.3f} ms: "
          f"{meas - cap2:.3f} ms more; spread over every={every} steps: {100 * (meas - cap2) / every / cap2:+.3f}% "
          f"of a step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2, help="A,B pairs of whole runs (0: skip part 1)")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--steps", type=int, default=None, help="override the default 1000 steps")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of part 2 (0: skip it)")
    parser.add_argument("--round-steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (part 1: OMP_NUM_THREADS of the runs; 0 leaves it alone)")
    args = parser.parse_args()
    if args.pairs:
        whole_runs(args.pairs, args.every, args.steps, args.threads)
    if args.rounds:
        in_process(args.rounds, args.round_steps, args.every, args.threads)


if __name__ == "__main__":
    main()
