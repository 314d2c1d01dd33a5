"""``ampguard train`` against the bare compiled loop on the same workload: tokens/s and MFU.

The issue's goal: on GPT-2 small (``task.preset: gpt2-small``) in bf16 with ``compile: true`` on an
H100/H200, ``ampguard train`` reaches >= 40% MFU and stays within 2% of the bare compiled loop's
tokens/s. Measured in one process, one contender after another, each over the same steps of the
same data (the charlm stream): the bare loop (``torch.compile`` of the model, fused AdamW, bf16
autocast, ``clip_grad_norm_``, nothing logged), ``ampguard train`` on its default path (on CUDA
the fast path), ``ampguard train`` on the exact path (``fast: false``), and the bare loop again
(so drift over the run shows: the ratios are taken against the mean of the two bare runs).

Each contender's throughput is read over its steady intervals (after ``--skip`` steps, which
pay for compiling): the bare loop synchronises at each interval's end; ``ampguard train``'s
comes from its own STATS lines (every ``--every`` steps, wall clock, the whole loop included:
records, the CSV, the monitors).

    python benchmarks/train_vs_bare.py --out benchmarks/out             # GPU: GPT-2 small
    python benchmarks/train_vs_bare.py --quick --device cpu              # a dry run on a CPU

Prints a table and writes ``train-vs-bare-<model>.json`` to ``--out``. A run that does not
finish (a time limit's SIGTERM, Ctrl-C, a guard's stop) is not reported: the script stops there
with the run's exit code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _config(args: argparse.Namespace, **extra):
    from ampguard.config import validate

    task = {"name": "charlm", "batch_size": args.batch}
    if args.quick:
        task.update({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32})
    elif args.model == "gpt2-small":
        task["preset"] = "gpt2-small"  # (--model default: the embedded default's 2 x 64, context 64)
    return validate({"task": task, "precision": args.precision, "device": args.device, "compile": not args.eager,
                     "steps": args.steps, "eval": {"enabled": False}, "checkpoint": {"enabled": False},
                     "log": {"every": args.every, **({"peak_tflops": args.peak_tflops} if args.peak_tflops else {})},
                     **extra})


def bare(args: argparse.Namespace) -> list[float]:
    """The bare compiled loop: tokens/s over each interval of ``--every`` steps after ``--skip``."""
    from ampguard.build import resolve_device
    from ampguard.precision import Precision
    from ampguard.tasks import build_task

    config = _config(args)
    device = resolve_device(config.device)
    task = build_task(config)
    model = task.model.to(device)
    if config.compile:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=config.optimizer.lr, betas=config.optimizer.betas,
                            fused=device.type == "cuda")
    autocast = Precision(config.precision, device.type).autocast
    stream = task.batches()
    rates, tokens, since = [], 0, None
    for step in range(1, args.steps + 1):
        x, y = next(stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast():
            loss = task.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += x.numel()
        if step == args.skip or (step > args.skip and (step - args.skip) % args.every == 0):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.perf_counter()
            if since is not None:
                rates.append(tokens / (now - since))
            since, tokens = now, 0
    return rates


class RunCutShort(Exception):
    """An ``ampguard train`` run that did not finish: its figures cover part of the run only."""

    def __init__(self, exit_code: int, ended: str) -> None:
        super().__init__(f"{ended} (exit {exit_code})")
        self.exit_code = exit_code


def ampguard(args: argparse.Namespace, **extra) -> tuple[list[float], list[str], str | None, str]:
    """``ampguard train`` in-process: tokens/s from its STATS lines after ``--skip``, and the MFU
    and throughput it reports itself. A run that did not finish raises :class:`RunCutShort`."""
    from ampguard.errors import ExitCode
    from ampguard.run_folder import RunPaths
    from ampguard.train import run

    config = _config(args, **extra)
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as folder:
        config = config.model_copy(update={"log": config.log.model_copy(update={"dir": folder, "name": "run"})})
        result = run(config, outputs=lambda: RunPaths.new_run_dir(config), console_every=10**9,
                     stats_every=args.every, print_fn=lines.append)
    if result.exit_code != ExitCode.OK:  # (a SIGTERM inside the run is a graceful stop, not the end of us)
        raise RunCutShort(int(result.exit_code), result.ended)
    stats = [line for line in lines if line.startswith("STATS ")]
    rates, mfus = [], []
    for line in stats:
        step = int(line.split()[1])
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if step > args.skip and "tokens/s" in fields:
            rates.append(float(fields["tokens/s"].replace(",", "")))
            mfus.append(fields.get("mfu", ""))
    return rates, mfus, result.throughput, result.path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=40, help="steps per measured interval")
    parser.add_argument("--skip", type=int, default=40, help="steps before the first measured interval")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=["gpt2-small", "default"], default="gpt2-small",
                        help="GPT-2 small, or the embedded default charlm (small: launch-bound on a GPU)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--quick", action="store_true", help="a tiny model (a dry run of the script)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every, args.skip, args.batch = 12, 4, 4, 4
    if (args.steps - args.skip) % args.every:
        parser.error("--steps minus --skip must be a multiple of --every")
    print(f"train vs bare, {args.model}: {args.device} "
          f"({torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {args.precision}, {'eager' if args.eager else 'compiled'}, batch "
          f"{args.batch}, {args.steps} steps, intervals of {args.every} after {args.skip}", flush=True)
    results: dict[str, dict] = {}
    for name, fn in (("bare loop", lambda: (bare(args), [], None, "")),
                     ("ampguard train", lambda: ampguard(args)),
                     ("ampguard train (fast: false)", lambda: ampguard(args, fast=False)),
                     ("bare loop (again)", lambda: (bare(args), [], None, ""))):
        start = time.perf_counter()
        try:
            rates, mfus, summary, path = fn()
        except RunCutShort as stopped:
            print(f"train_vs_bare: {name}: the run did not finish ({stopped}); not reported, stopping here",
                  file=sys.stderr, flush=True)
            return stopped.exit_code or 1
        results[name] = {"tokens_per_s": rates, "median": statistics.median(rates) if rates else None,
                         "mfu": mfus, "summary": summary, "path": path, "wall_s": time.perf_counter() - start}
        print(f"  {name:<30} {results[name]['median'] or float('nan'):>12,.0f} tokens/s  "
              f"intervals {[round(r) for r in rates]}  {mfus[-1] if mfus else ''}  "
              f"({results[name]['wall_s']:.0f} s{', ' + path if path else ''})", flush=True)
    bare_rates = [r["median"] for k, r in results.items() if k.startswith("bare") and r["median"]]
    bare_rate = statistics.mean(bare_rates) if bare_rates else None
    for name, r in results.items():
        r["ratio_to_bare"] = r["median"] / bare_rate if r["median"] and bare_rate else None
        ratio = "no ratio" if r["ratio_to_bare"] is None else f"x{r['ratio_to_bare']:.3f}"  # (no interval measured)
        print(f"  {name:<30} {ratio} of the bare loop's tokens/s"
              + (f"; run card: {r['summary']}" if r["summary"] else ""), flush=True)
    first, again = results["bare loop"]["median"], results["bare loop (again)"]["median"]
    drift = again / first - 1 if first and again else None
    print(f"  drift between the two bare runs: {'n/a' if drift is None else f'{drift:+.1%}'}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"train-vs-bare-{args.model}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                 "results": results, "drift": drift}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
