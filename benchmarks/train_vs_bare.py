"""``ampguard train`` against the bare compiled loop on the same workload: tokens/s and MFU.

The issue's goal: on GPT-2 small (``task.preset: gpt2-small``) in bf16 with ``compile: true`` on an
H100/H200, ``ampguard train`` reaches >= 40% MFU and stays within 2% of the bare compiled loop's
tokens/s. Measured in one process, over the same steps of the same data (the charlm stream): the
bare loop (``torch.compile`` of the model, fused AdamW, bf16 autocast, ``clip_grad_norm_``, nothing
logged) against ``ampguard train`` on its default path (on CUDA the fast path), and with
``--exact`` ``ampguard train`` on the exact path (``fast: false``) too.

Paired blocks: each of ``--blocks`` blocks runs every contender once, one after another, in the
balanced orders of ``ampguard bench`` (:func:`ampguard.bench.balanced_orders`: bare first in one
block, second in the next, ...; blocks are rounded up to whole cycles of those orders), and each
contender's ratio to the bare loop is taken within its block, so drift of the machine falls on both
alike. The figure is the median of the per-block ratios with its 95% interval from their order
statistics (:func:`ampguard.bench.median_interval`: distribution-free; none below 6 blocks). The
goal's verdict (met: the interval's low end >= 0.98; missed: its high end below) is given only when
the figure resolves it: when the bare loop's own runs differ by more than the goal's 2% (most over
least: the machine drifted or was busy), the figure is flagged as not resolved, in a line and in
the JSON (``resolved``: false, ``unresolved_why``), and so it is without an interval or with one
that straddles 0.98.

Each run's throughput is the median of its steady intervals (after ``--skip`` steps, which pay for
compiling): the bare loop synchronises at each interval's end; ``ampguard train``'s come from its
own STATS lines (every ``--every`` steps, wall clock, the whole loop included: records, the CSV,
the monitors). ``ampguard train``'s last STATS interval is reported apart (``last_interval``), not
in its median: on the fast path the STATS line of step N is written when step N's record is read
back, up to ``LAG`` (2) steps after it was trained, and its tokens are counted as steps start; so
the last interval ends at the run's final drain (the GPU's end of the last step) but counts the
tokens of up to ``LAG`` steps fewer, and reads up to ``LAG / --every`` low (on an H200 at 40 steps
an interval: 2.5-3% below the others). The middle intervals are shifted alike at both ends.

    python benchmarks/train_vs_bare.py --out benchmarks/out             # GPU: GPT-2 small
    python benchmarks/train_vs_bare.py --quick --device cpu              # a dry run on a CPU

On a CPU torch's intra-op threads are pinned for every run, as ``ampguard bench`` pins them
(``--threads``, default the CPUs this process may use), and the header says how many, with the
machine's load before the runs: OpenMP's threads on a machine other work shares swung the same
bare loop's figures ~60x (review 54o; ``--threads 1`` is the steadiest there).

Prints a line per run, then the ratios, and writes ``train-vs-bare-<model>.json`` to the folder
``--out`` (``train-vs-bare-quick.json`` for ``--quick``, a 2 x 32 model: never over a measured
result). Every argument and ``--out`` are checked before the first run, each bad one a one-line
usage error (exit 2) with nothing run or written: ``--out`` must be a folder (made if missing) this
process can write to, without that file in it already (no run overwrites an earlier result: move
it away first). The JSON is written at the end, whole or not at all (a temporary file beside it,
then renamed; were the file made during the run, the result stays in the temporary file, said on
stderr, exit 1). A run that does not finish (a time limit's SIGTERM, Ctrl-C, a guard's stop) is
not reported: the script stops there with the run's exit code, writing nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

TOLERANCE = 0.02
"""The goal: ``ampguard train`` within 2% of the bare compiled loop's tokens/s."""
BARE, OURS, EXACT = "bare loop", "ampguard train", "ampguard train (fast: false)"
BARE_PRECISIONS = ("bf16", "fp32")
"""The precisions :func:`bare` runs as ``ampguard train`` does: autocast (or none), backward, step.
fp16 would need the recipe's GradScaler and fp8 torchao's float8 layers (review 52b: they were taken,
and the figure compared other work)."""


def _config(args: argparse.Namespace, **extra):
    from ampguard.config import validate

    task = {"name": "charlm", "batch_size": args.batch}
    if args.quick:
        task.update({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32})
    elif args.model == "gpt2-small":
        task["preset"] = "gpt2-small"  # (--model default: the embedded default's 2 x 64, context 64)
    return validate({"task": task, "precision": args.precision, "device": args.device, "compile": not args.eager,
                     "steps": args.steps, "eval": {"enabled": False}, "checkpoint": {"enabled": False},
                     # (no report.png: drawn as the run ends into a folder deleted at once, ~0.7 s of a short run)
                     "log": {"every": args.every, "plot": False,
                             **({"peak_tflops": args.peak_tflops} if args.peak_tflops else {})},
                     **extra})


def bare(args: argparse.Namespace) -> dict[str, Any]:
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
    return {"tokens_per_s": rates, "last_interval": None, "mfu": [], "summary": None, "path": ""}


class RunCutShort(Exception):
    """An ``ampguard train`` run that did not finish: its figures cover part of the run only."""

    def __init__(self, exit_code: int, ended: str) -> None:
        super().__init__(f"{ended} (exit {exit_code})")
        self.exit_code = exit_code


def ampguard(args: argparse.Namespace, **extra) -> dict[str, Any]:
    """``ampguard train`` in-process: tokens/s from its STATS lines after ``--skip`` (the last one
    apart: the module's docstring says why), the MFU of each, and the throughput its run card
    reports. A run that did not finish raises :class:`RunCutShort`."""
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
    rates, mfus = [], []
    for line in (line for line in lines if line.startswith("STATS ")):
        step = int(line.split()[1])
        fields = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if step > args.skip and "tokens/s" in fields:
            rates.append(float(fields["tokens/s"].replace(",", "")))
            mfus.append(fields.get("mfu", ""))
    return {"tokens_per_s": rates[:-1], "last_interval": rates[-1] if rates else None, "mfu": mfus[:-1],
            "summary": result.throughput, "path": result.path}


def verdict(ratios: list[float], bare_medians: list[float], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """The figure from the per-block ratios (a contender's tokens/s over the bare loop's in the same
    block) and the bare loop's own runs (their medians, in the order they ran): the median ratio and
    its 95% interval, the bare runs' ``drift`` (last over first, - 1) and ``spread`` (most over
    least, - 1), whether the figure resolves the goal (``resolved``; ``unresolved_why`` says why
    not) and, when it does, the goal's verdict (``goal``: ``"met"`` or ``"missed"``).

    Example::

        >>> v = verdict([0.99, 0.995, 0.993, 0.996, 0.994, 0.992], [670e3, 671e3, 669e3, 672e3, 670e3, 671e3])
        >>> v["ratio"], v["low"], v["high"], v["resolved"], v["goal"]
        (0.9935, 0.99, 0.996, True, 'met')
        >>> v = verdict([1.15, 1.2, 1.1, 1.3, 1.2, 1.25], [547.0, 10e3, 9e3, 11e3, 10e3, 10e3])
        >>> v["resolved"], v["goal"], v["unresolved_why"][:56]
        (False, None, "the bare loop's own runs differ by 1911.0% (most over le")
    """
    from ampguard.bench import median_interval

    med, low, high = median_interval(ratios) if ratios else (math.nan, math.nan, math.nan)
    known = [m for m in bare_medians if m]
    drift = known[-1] / known[0] - 1 if len(known) > 1 else math.nan
    spread = max(known) / min(known) - 1 if len(known) > 1 else math.nan
    floor = 1 - tolerance
    why = None
    if not spread <= tolerance:  # (nan too: one bare run says nothing about the machine)
        why = (f"the bare loop's own runs differ by {spread:.1%} (most over least), more than the goal's "
               f"{tolerance:.0%}: the machine drifted or was busy" if not math.isnan(spread) else
               "one bare run: nothing says whether the machine drifted")
    elif math.isnan(low):
        why = f"{len(ratios)} blocks give no 95% interval (6 needed)"
    elif low < floor <= high:
        why = f"its interval [{low:.3f}, {high:.3f}] straddles {floor:g}"
    goal = None if why else ("met" if low >= floor else "missed")
    return {"ratio": med, "low": low, "high": high, "ratios": ratios, "drift": drift, "spread": spread,
            "tolerance": tolerance, "resolved": why is None, "unresolved_why": why, "goal": goal}


def result_path(args: argparse.Namespace) -> Path:
    """Where the JSON goes: ``train-vs-bare-<model>.json`` in the folder ``--out``."""
    return args.out / f"train-vs-bare-{'quick' if args.quick else args.model}.json"


def out_problem(path: Path) -> str | None:
    """Why the JSON cannot be written to ``path`` at the end of the run, or ``None``; checked
    before any run, so that a bad ``--out`` costs no device time. The folder must be one (or be
    missing, with a folder above it this process can write in), and ``path`` must not be there
    yet: an earlier result is never overwritten.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     folder = Path(tmp)
        ...     _ = (folder / "train-vs-bare-quick.json").write_text("{}")
        ...     print(out_problem(folder / "new" / "train-vs-bare-default.json"))
        ...     print(out_problem(folder / "train-vs-bare-quick.json").split(": ", 1)[1])
        ...     print(out_problem(folder / "train-vs-bare-quick.json" / "x.json").split(": ", 1)[1])
        None
        train-vs-bare-quick.json is already there (an earlier result: move it away, or give another --out)
        not a folder
    """
    folder = path.parent
    if folder.exists() and not folder.is_dir():
        return f"--out {folder}: not a folder"
    if path.exists() or path.is_symlink():
        return f"--out {folder}: {path.name} is already there (an earlier result: move it away, or give another --out)"
    existing = folder
    while not existing.exists():  # (a folder that is missing is made at the end, in the nearest one there)
        if existing.is_symlink():
            return f"--out {folder}: {existing} is a link to nothing"
        existing = existing.parent
    if not existing.is_dir():
        return f"--out {folder}: {existing} is not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):  # (a probe, gone at once: os.access says yes to root)
            pass
    except OSError as err:
        return f"--out {folder}: cannot write in {existing} ({err.strerror or err})"
    return None


def write_result(path: Path, data: dict[str, Any]) -> int:
    """``data`` as JSON at ``path``, whole or not at all: a temporary file beside it, then
    ``os.replace``; never over a file (one made there during the run stays, and the result is
    left in the temporary file, said on stderr: exit 1)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1))
        os.chmod(part, 0o644)
    except OSError as err:
        print(f"train_vs_bare: the JSON could not be written to {path.parent} ({err.strerror or err})",
              file=sys.stderr, flush=True)
        return 1
    if path.exists() or path.is_symlink():
        print(f"train_vs_bare: {path} was made during the run, not overwritten: this run's JSON is {part}",
              file=sys.stderr, flush=True)
        return 1
    os.replace(part, path)  # (whole or not at all: a time limit's SIGTERM mid-write leaves no half file)
    return 0


def _number(v: Any) -> Any:
    """``v`` as JSON takes it: nan as null."""
    return None if isinstance(v, float) and math.isnan(v) else v


def main() -> int:
    from ampguard.bench import INTERVAL, ScriptParser, _load, _load_text, _usable_cpus, balanced_orders, in_whole_cycles
    from ampguard.build import resolve_device
    from ampguard.errors import InputError, counted

    parser = ScriptParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16", help="bf16 or fp32 (the bare loop runs no other as "
                        "ampguard train does)")
    parser.add_argument("--steps", type=int, default=80, help="steps a run")
    parser.add_argument("--every", type=int, default=20, help="steps per measured interval")
    parser.add_argument("--skip", type=int, default=20, help="steps before the first measured interval")
    parser.add_argument("--blocks", type=int, default=6,
                        help="paired blocks, each running every contender once (6 or more for a 95%% interval; "
                        "rounded up to whole cycles of the orders)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", choices=["gpt2-small", "default"], default="gpt2-small",
                        help="GPT-2 small, or the embedded default charlm (small: launch-bound on a GPU)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile")
    parser.add_argument("--exact", action="store_true", help="also ampguard train on the exact path (fast: false)")
    parser.add_argument("--quick", action="store_true", help="a tiny model (a dry run of the script)")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU only: torch's intra-op threads for every run (default: the CPUs this process may "
                        "use, as ampguard bench pins them; 1 is the steadiest on a machine other work shares)")
    parser.add_argument("--out", type=Path, default=None,
                        help="a folder for the JSON (made if missing); an earlier result there is refused, "
                        "not replaced")
    args = parser.parse_args()
    if args.precision not in BARE_PRECISIONS:  # review 52b: fp8 timed bf16 autocast, fp16 no scaler, against train's
        parser.error(f"--precision {args.precision}: the bare loop here runs bf16 or fp32 only (in fp16 it has no "
                     "GradScaler, in fp8 no float8 layers: it would time other work than ampguard train); "
                     "`ampguard bench --precisions fp16,fp8` compares those")
    if args.quick:
        args.steps, args.every, args.skip, args.batch = 12, 4, 4, 4
    for flag, value in (("--steps", args.steps), ("--every", args.every), ("--skip", args.skip),
                        ("--blocks", args.blocks), ("--batch", args.batch)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if args.skip % args.every:
        parser.error("--skip must be a multiple of --every (ampguard train's STATS lines fall on multiples of "
                     "--every, and the bare loop's intervals must cover the same steps)")
    if args.steps <= args.skip or (args.steps - args.skip) % args.every or (args.steps - args.skip) // args.every < 2:
        parser.error("--steps minus --skip must be a multiple of --every, and at least two of them (the last "
                     "interval of ampguard train is reported apart)")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        parser.error(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    try:  # (the config the runs take, and the device, judged before any run: a bad one is one line)
        _config(args)
        device = resolve_device(args.device)
    except InputError as err:
        parser.error(str(err))
    if args.threads is not None and device.type != "cpu":  # (as ampguard bench: on a GPU it would do nothing, unsaid)
        parser.error(f"--threads {args.threads} pins a CPU's intra-op threads; on {device.type} the steps run on the "
                     "GPU and it is not used: leave it out")
    path = None if args.out is None else result_path(args)
    if path is not None and (problem := out_problem(path)):
        parser.error(problem)
    contenders = {BARE: lambda: bare(args), OURS: lambda: ampguard(args)}
    if args.exact:
        contenders[EXACT] = lambda: ampguard(args, fast=False)
    names = list(contenders)
    orders = balanced_orders(len(names))
    blocks = in_whole_cycles(args.blocks, len(orders))
    load = _load()  # (before the runs add their own threads to it)
    threads = ""
    if device.type == "cpu":  # review 54o: unpinned, the runs took whatever torch chose, and shared cores swung them
        torch.set_num_threads(args.threads or _usable_cpus())
        threads = f", {counted(torch.get_num_threads(), 'thread')}"
        if torch.get_num_threads() > _usable_cpus():
            threads += f" on {counted(_usable_cpus(), 'usable CPU')} (oversubscribed: the threads share cores)"
    label = "quick (2x32)" if args.quick else "gpt2-small (12x768)" if args.model == "gpt2-small" else "default (2x64)"
    print(f"train vs bare, {label}: {args.device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {args.precision}, {'eager' if args.eager else 'compiled'}, batch "
          f"{args.batch}, {args.steps} steps a run, intervals of {args.every} after {args.skip}{threads}"
          f"{_load_text(load)}; {blocks} paired blocks of {', '.join(names)}", flush=True)
    if blocks != args.blocks:
        print(f"  {blocks} blocks, not {args.blocks}: whole cycles of the {len(orders)} orders (each contender "
              "in each place alike)", flush=True)
    runs: list[dict[str, dict[str, Any]]] = []  # per block: each contender's run
    for block in range(blocks):
        order = [names[i] for i in orders[block % len(orders)]]
        runs.append({})
        for name in order:
            start = time.perf_counter()
            try:
                run = contenders[name]()
            except RunCutShort as stopped:
                print(f"train_vs_bare: {name}: the run did not finish ({stopped}); not reported, stopping here",
                      file=sys.stderr, flush=True)
                return stopped.exit_code or 1
            rates = run["tokens_per_s"]
            run.update(median=statistics.median(rates) if rates else None, wall_s=time.perf_counter() - start,
                       position=order.index(name))
            runs[-1][name] = run
            last = "" if run["last_interval"] is None else f" last interval {run['last_interval']:,.0f} kept apart"
            print(f"  block {block + 1}/{blocks}  {name:<30} {run['median'] or math.nan:>12,.0f} tokens/s  "
                  f"intervals {[round(r) for r in rates]}{last}  {run['mfu'][-1] if run['mfu'] else ''}  "
                  f"({run['wall_s']:.0f} s{', ' + run['path'] if run['path'] else ''})", flush=True)
    bare_medians = [b[BARE]["median"] for b in runs]
    results = {}
    for name in names[1:]:
        ratios = [b[name]["median"] / b[BARE]["median"] for b in runs if b[name]["median"] and b[BARE]["median"]]
        results[name] = verdict(ratios, bare_medians)
        r = results[name]
        interval = "no interval" if math.isnan(r["low"]) else f"[{r['low']:.3f}, {r['high']:.3f}]"
        cards = [b[name]["summary"] for b in runs if b[name]["summary"]]
        print(f"  {name:<30} x{r['ratio']:.3f} {interval} of the bare loop's tokens/s (median of {len(ratios)} "
              f"paired blocks, 95%)" + (f"; last run card: {cards[-1]}" if cards else ""), flush=True)
    ours = results[OURS]
    print(f"  the bare loop's own runs: drift {ours['drift']:+.1%} (last over first), spread {ours['spread']:.1%} "
          "(most over least)", flush=True)
    if ours["resolved"]:
        print(f"  goal (within {TOLERANCE:.0%} of the bare loop's tokens/s): {ours['goal']}", flush=True)
    else:
        print(f"  NOT RESOLVED: the figure cannot tell the goal (within {TOLERANCE:.0%}): {ours['unresolved_why']}",
              flush=True)
    if path is not None:
        data = {"args": {k: str(v) for k, v in vars(args).items()}, "label": label, "blocks": runs,
                "results": {k: {f: _number(v) for f, v in r.items()} for k, r in results.items()},
                "threads": torch.get_num_threads() if device.type == "cpu" else None, "load_avg": load,
                "interval": INTERVAL, "confidence": 0.95, "tolerance": TOLERANCE, "resolved": ours["resolved"],
                "unresolved_why": ours["unresolved_why"], "goal": ours["goal"],
                "drift": _number(ours["drift"]), "spread": _number(ours["spread"])}
        return write_result(path, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
