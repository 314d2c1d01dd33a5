"""``ampguard bench --processes N``: the same bench in N fresh processes, one after another, and
each contender's ratio to the bare loop across them.

One process's interval says how well its rounds pin down *that process's* ratio. A second
process of the same code lands elsewhere: its memory layout, its allocations, what the machine
was doing (on a shared 2-core CPU the tiny MLP's ``ampguard + csv`` read 1.087-1.118 in six
processes whose own intervals were ±0.5%). A claim about the code, not about one process, needs
the spread between processes, so here each process's median ratio is one value, the figure is
their median and its 95% interval comes from their order statistics
(:func:`~ampguard.bench.median_interval`: distribution-free, and none below 6 processes). The
processes run one after another, never side by side (they would time each other), each with
``--budget / N`` seconds a case, so the whole takes about as long as one process given
``--budget`` (plus N process starts); each is ``ampguard bench --json`` with the same settings,
in a session of its own, so Ctrl-C or a SIGTERM reaches only this process, which ends the
running one with SIGTERM and reports the processes that finished.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .bench import (
    CONFIDENCE, INTERVAL, Bare, _reach, hold_output, interrupted_by, json_number, median_interval, output_written,
)
from .errors import counted
from .signals import Interrupted, lost_stdout, signal_numbered

MIN_PROCESSES_FOR_INTERVAL = 6
"""The fewest processes with a 95% interval of their median (:func:`~ampguard.bench.median_interval`)."""


@dataclass
class Across:
    """One contender's ratio to the bare loop across processes: each process's own median ratio
    and half-width (``ratios``, ``half_widths``: in the order the processes ran; ``None`` where
    a process had no bare loop or no interval), their median, and its interval (nan below
    :data:`MIN_PROCESSES_FOR_INTERVAL`)."""

    workload: str
    precision: str
    contender: str
    ratios: list[float] = field(default_factory=list)
    half_widths: list[float | None] = field(default_factory=list)
    ratio: float = math.nan
    low: float = math.nan
    high: float = math.nan

    @property
    def half_width(self) -> float:
        """How far the interval reaches from the ratio, relative to it (0.01: ± 1%); nan without one."""
        return _reach(self.ratio, self.low, self.high) if not math.isnan(self.low) else math.nan

    @property
    def within(self) -> float | None:
        """The median of the processes' own half-widths: how narrow one process claimed to be."""
        known = [h for h in self.half_widths if h is not None]
        return statistics.median(known) if known else None


def across(children: Sequence[dict[str, Any]]) -> list[Across]:
    """Each contender's :class:`Across` from the processes' ``--json`` outputs, in the first
    process's order (a contender some process left out has fewer values; the bare loop, whose
    ratio is 1 by definition, is left out unless it ran alone).

    Example (six processes, the guard 1.09-1.11 in them)::

        >>> child = lambda r: {"results": [
        ...     {"workload": "m", "precision": "bf16", "contender": "bare loop", "ratio_to_bare": 1.0, "half_width": None},
        ...     {"workload": "m", "precision": "bf16", "contender": "g", "ratio_to_bare": r, "half_width": 0.005}]}
        >>> (row,) = across([child(r) for r in (1.10, 1.09, 1.11, 1.10, 1.095, 1.105)])
        >>> row.contender, round(row.ratio, 4), (row.low, row.high), row.within
        ('g', 1.1, (1.09, 1.11), 0.005)
        >>> round(row.half_width, 4)
        0.0091
        >>> math.isnan(across([child(1.1)] * 5)[0].low)  # five processes: no 95% interval
        True
    """
    rows: dict[tuple[str, str, str], Across] = {}
    for child in children:
        results = child.get("results", [])
        alone = {(r["workload"], r["precision"]) for r in results if r["contender"] == Bare.name} - {
            (r["workload"], r["precision"]) for r in results if r["contender"] != Bare.name}
        for r in results:
            key = (r["workload"], r["precision"], r["contender"])
            if r["contender"] == Bare.name and key[:2] not in alone:
                continue
            if r.get("ratio_to_bare") is None:
                continue
            row = rows.setdefault(key, Across(*key))
            row.ratios.append(float(r["ratio_to_bare"]))
            row.half_widths.append(r.get("half_width"))
    for row in rows.values():
        row.ratio, row.low, row.high = median_interval(row.ratios, confidence=CONFIDENCE)
    return list(rows.values())


def _pct(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"±{100 * x:.2f}%"


def table(rows: Sequence[Across], quick: bool = False) -> str:
    """The rows as a Markdown table: the median ratio, its interval across processes, each
    process's ratio, and how narrow one process's own interval claimed to be.

    Example::

        >>> print(table([Across("m", "bf16", "g", [1.1, 1.09], [0.005, None], 1.095)]))  # doctest: +NORMALIZE_WHITESPACE
        | workload | precision | contender | ratio to bare (median of processes) | 95% interval across processes | each process | one process's own interval (median) |
        |---|---|---|---|---|---|---|
        | m | bf16 | g | 1.095 | n/a (2 processes; 6 needed) | 1.1 1.09 | ±0.50% |
    """
    lines = ["| workload | precision | contender | ratio to bare (median of processes) | 95% interval across processes "
             "| each process | one process's own interval (median) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        interval = (f"[{r.low:.3f}, {r.high:.3f}] ({_pct(r.half_width)})" if not math.isnan(r.low) else
                    "n/a (--quick: a smoke test)" if quick else
                    f"n/a ({counted(len(r.ratios), 'process', 'processes')}; {MIN_PROCESSES_FOR_INTERVAL} needed)")
        each = " ".join(f"{x:.4g}" for x in r.ratios)
        lines.append(f"| {r.workload} | {r.precision} | {r.contender} | {r.ratio:.3f} | {interval} | {each} | "
                     f"{_pct(r.within)} |")
    return "\n".join(lines)


def stops(children: Sequence[dict[str, Any]]) -> list[str]:
    """One line per case: why each process's rounds ended, and after how many (each process's
    ``stop``, which the table's ratios do not show: review 49e, "the table says which").

    Example::

        >>> child = lambda stop, n: {"results": [{"workload": "m", "precision": "bf16", "contender": "bare loop",
        ...                                       "stop": stop, "rounds": [1.0] * n}]}
        >>> stops([child("resolved", 96), child("budget", 40)])
        ['m bf16: each process stopped: resolved after 96 rounds, the time budget after 40 rounds']
    """
    said: dict[tuple[str, str], list[str]] = {}
    words = {"budget": "the time budget", "max rounds": "the most rounds", "fixed": "fixed rounds"}
    for child in children:
        for r in child.get("results", []):
            if r.get("contender") == Bare.name and r.get("stop") is not None:
                said.setdefault((r["workload"], r["precision"]), []).append(
                    f"{words.get(r['stop'], r['stop'])} after {counted(len(r.get('rounds') or []), 'round')}")
    return [f"{w} {p}: each process stopped: {', '.join(each)}" for (w, p), each in said.items()]


def resolution(rows: Sequence[Across], resolve: float | None) -> list[str]:
    """A line on what the processes resolved: the widest interval against ``resolve``.

    Example::

        >>> resolution([Across("m", "bf16", "g", [1.1] * 6, [0.005] * 6, 1.1, 1.09, 1.12)], 0.01)
        ['across processes: the widest interval reaches ±1.82% (g, m bf16), not within ±1% asked (up to 8 processes the interval is their least and most; from 9 on, more processes narrow it)']
        >>> resolution([Across("m", "bf16", "g", [1.1] * 2, [None] * 2, 1.1)], 0.01)
        ['across processes: no interval below 6 processes (2 ran): --processes 6 or more for one']
    """
    if not rows:
        return []
    if any(math.isnan(r.low) for r in rows):
        fewest = min(len(r.ratios) for r in rows)
        return [f"across processes: no interval below {MIN_PROCESSES_FOR_INTERVAL} processes ({fewest} ran): "
                f"--processes {MIN_PROCESSES_FOR_INTERVAL} or more for one"]
    widest = max(rows, key=lambda r: r.half_width)
    said = f"across processes: the widest interval reaches {_pct(widest.half_width)} ({widest.contender}, " \
           f"{widest.workload} {widest.precision})"
    if resolve is None:
        return [said]
    if widest.half_width <= resolve:
        return [f"{said}: resolved to ±{100 * resolve:g}%"]
    return [f"{said}, not within ±{100 * resolve:g}% asked (up to 8 processes the interval is their least and "
            "most; from 9 on, more processes narrow it)"]


def to_json(children: Sequence[dict[str, Any]], rows: Sequence[Across], resolve: float | None, n: int,
            stopped: str | None) -> str:
    """Every process's own ``--json`` output (``children``, in order) and the rows across them.

    Example::

        >>> data = json.loads(to_json([], [Across("m", "bf16", "g", [1.1], [None], 1.1)], 0.01, 6, "interrupted"))
        >>> data["processes"], data["ran"], data["stopped"], data["across"][0]["ratio"], data["across"][0]["low"]
        (6, 0, 'interrupted', 1.1, None)
    """
    return json.dumps({
        "processes": n, "ran": len(children), "stopped": stopped, "resolve": resolve, "confidence": CONFIDENCE,
        "interval": f"{INTERVAL}, of the processes' medians",
        "across": [{"workload": r.workload, "precision": r.precision, "contender": r.contender,
                    "ratio": json_number(r.ratio), "low": json_number(r.low), "high": json_number(r.high),
                    "half_width": json_number(r.half_width), "ratios": r.ratios, "half_widths": r.half_widths,
                    "within": r.within} for r in rows],
        "children": list(children)}, indent=2)


def child_args(*, device: str, models: str, precisions: str, steps: int, rounds: int, warmup: int, fused: bool,
               peers: bool, peak_tflops: float | None, quick: bool, resolve_pct: float, budget_s: float,
               threads: int | None, aa: bool, batch: int | None = None) -> list[str]:
    """The ``ampguard bench`` arguments of one process: :func:`ampguard.bench.run`'s settings
    (``budget_s`` already its share) as flags, numbers written in full (``repr``).

    Example::

        >>> child_args(device="cpu", models="mlp", precisions="bf16", steps=30, rounds=7, warmup=5, fused=False,
        ...            peers=False, peak_tflops=None, quick=False, resolve_pct=1.0, budget_s=20.0, threads=None,
        ...            aa=True)  # doctest: +NORMALIZE_WHITESPACE
        ['--device', 'cpu', '--models', 'mlp', '--precisions', 'bf16', '--steps', '30', '--rounds', '7',
         '--warmup', '5', '--resolve', '1.0', '--budget', '20.0', '--no-peers']
    """
    return ["--device", device, "--models", models, "--precisions", precisions, "--steps", str(steps),
            "--rounds", str(rounds), "--warmup", str(warmup), "--resolve", repr(resolve_pct),
            "--budget", repr(budget_s), *(["--fused"] if fused else []), *(["--no-peers"] if not peers else []),
            *(["--quick"] if quick else []), *(["--peak-tflops", repr(peak_tflops)] if peak_tflops is not None else []),
            *(["--threads", str(threads)] if threads is not None else []), *(["--no-aa"] if not aa else []),
            *(["--batch", str(batch)] if batch is not None else [])]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """In a child process before it runs: SIGTERM when this process dies (Linux's
    ``PR_SET_PDEATHSIG``), so a parent killed outright (SIGKILL, the OOM killer, a closed
    terminal's SIGHUP) leaves no bench running on in its own session."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # (1: PR_SET_PDEATHSIG)


def _launch(argv: list[str]) -> subprocess.Popen:
    """One process of the bench: its stdout (the JSON) read here, its stderr (the progress
    lines) the terminal's, in a session of its own (the terminal's Ctrl-C reaches this process
    only, which ends it), ended when this process dies."""
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _exit_of(returncode: int) -> tuple[int, str]:
    """A child's exit status as this process's, and in words: a signal's death (``-9``) is
    ``128 + 9``, killed by SIGKILL (the OOM killer, say).

    Example::

        >>> _exit_of(-9), _exit_of(1)
        ((137, 'was killed by SIGKILL'), (1, 'exited 1'))
    """
    if returncode < 0:
        number = signal_numbered(-returncode)  # (a number this OS names no signal: said as one)
        return 128 - returncode, f"was killed by {getattr(number, 'name', f'signal {-returncode}')}"
    return returncode, f"exited {returncode}"


def run_across(n: int, child_args: list[str], *, resolve: float | None, as_json: bool, quick: bool = False,
               launch: Callable[[list[str]], subprocess.Popen] = _launch) -> int:
    """Run ``ampguard bench *child_args --json`` ``n`` times, one after another, then print the
    rows across them (a table, or JSON with ``as_json``). Returns 0; 130 or 143 when Ctrl-C or
    a SIGTERM stopped it (the processes that finished are reported; the running one is ended,
    :func:`_end`: its stdout closed, then SIGTERM, then SIGKILL after a minute; it is left out),
    also one that came after the last process, before the output; a process that fails (or prints
    no JSON) ends it with its exit code (1 for no JSON; 128 + the signal for one killed by a
    signal), after the rows of those before it. Progress goes to stderr (each process's own
    lines, as they come). ``quick``: said to be a smoke test, and no interval is given. While the
    rows are printed a signal waits (:func:`~ampguard.signals.held_signals`): the output is
    never cut short (not at a pipe's 64 KiB either: the signals are blocked at the OS level), and
    once it is whole :class:`~ampguard.signals.Interrupted` (143 or 130) is raised, as the
    one-process bench does (a code found before it stands: an interrupt's in the processes, a
    failed process's, a lost stdout's); a second signal there ends the process at once, the
    output cut (a reader that stopped reading). stdout that could not take the output (a full
    disk) is exit 74 (:func:`~ampguard.bench.output_written`)."""
    from .errors import ExitCode

    argv = [sys.executable, "-m", "ampguard", "bench", *child_args, "--json"]
    children: list[dict[str, Any]] = []
    code, stopped = 0, None
    say = sys.stderr
    print(f"ampguard bench across {counted(n, 'process', 'processes')}, one after another (each: "
          f"{' '.join(child_args)}): each ratio is the median of the processes' own, its "
          f"{round(100 * CONFIDENCE)}% interval from their order statistics", file=say, flush=True)
    if quick:
        print("--quick: a smoke test that the processes run, not a measurement (no interval)", file=say, flush=True)
    proc: subprocess.Popen | None = None
    # from the end of the processes a signal waits until the output is whole (it was cut at the
    # pipe's 64 KiB and exited 130 for a SIGTERM), then exits 143 or 130 as the one-process bench
    # does (the command line's "ampguard: interrupted"); after an interrupt in the processes, the
    # first signal's code stands. The hold is entered before interrupted_by is left (a signal
    # between the two lost every process's rows), and a signal before it is taken as an interrupt
    try:
        with interrupted_by(signal.SIGINT, signal.SIGTERM, once=True) as came, \
                contextlib.ExitStack() as holding:  # (a second signal: ignored)
            i = 0
            try:
                for i in range(1, n + 1):
                    print(f"process {i} of {n}:", file=say, flush=True)
                    proc = launch(argv)
                    out, _ = proc.communicate()
                    failed = None
                    if proc.returncode != 0:
                        code, failed = _exit_of(proc.returncode)
                    else:
                        try:
                            children.append(json.loads(out))
                        except ValueError:
                            code, failed = 1, "printed no JSON"
                    proc = None
                    if failed is not None:
                        stopped = f"process {i} {failed}"
                        print(f"bench: process {i} of {n} {failed} (its lines above); the "
                              f"{counted(len(children), 'process', 'processes')} before it follow", file=say,
                              flush=True)
                        break
                hold_output(holding)  # (a second signal: cut, exit)
            except KeyboardInterrupt:
                if proc is not None and proc.poll() is None:
                    _end(proc)
                code = int(ExitCode.TERMINATED if came == [signal.SIGTERM] else ExitCode.INTERRUPTED)
                stopped = "interrupted"
                where = (f"in process {i} of {n}" if proc is not None else  # (else between processes, or after them)
                         f"after process {i} of {n}" if i else f"before process 1 of {n}")
                print(f"bench: interrupted {where}; the {counted(len(children), 'process', 'processes')} before "
                      "it follow", file=say, flush=True)
                hold_output(holding)
            rows = across(children)
            if quick:
                for row in rows:
                    row.low = row.high = math.nan
            if as_json:
                print(to_json(children, rows, resolve, n, stopped), flush=True)
            elif rows:
                print("\n".join([table(rows, quick), *([] if quick else [*stops(children), *resolution(rows, resolve)])]),
                      flush=True)
    except Interrupted as held:  # (the hold's: a signal came while the output was written, which is whole; the code
        # found before it stands: an interrupt's in the processes, a failed process's, a lost stdout's 74;
        # review 52b: stdout's reader that left while it was written is no interrupt, its own code stands)
        if stopped is None and lost_stdout() is None and held.exit_code != ExitCode.BROKEN_PIPE:
            raise
    return output_written(as_json, code)


def _end(proc: subprocess.Popen) -> None:
    """End a running process of the bench: its stdout closed first, so that one blocked writing
    its JSON into the pipe (over 64 KiB, which nothing reads any more) is not left waiting there,
    its SIGTERM held until the JSON is whole (it was SIGKILLed a minute later); then SIGTERM, and
    SIGKILL after a minute."""
    if proc.stdout is not None:
        with contextlib.suppress(OSError):
            proc.stdout.close()
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(*, processes: int, device: str, models: str, precisions: str, steps: int, rounds: int, warmup: int,
        fused: bool, peers: bool, peak_tflops: float | None, quick: bool, as_json: bool, resolve_pct: float,
        budget_s: float, threads: int | None, aa: bool, batch: int | None = None) -> int:
    """``ampguard bench --processes N`` (N > 1): the arguments checked as one process's would be
    (:func:`ampguard.bench.run`: an :class:`~ampguard.errors.InputError` before any process
    starts), then :func:`run_across` with each process's share of ``budget_s``.

    Example::

        >>> run(processes=2, device="cpu", models="resnet", precisions="fp32", steps=1, rounds=1, warmup=1,
        ...     fused=False, peers=False, peak_tflops=None, quick=False, as_json=False, resolve_pct=1.0,
        ...     budget_s=10.0, threads=None, aa=True)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: bench: unknown model 'resnet' (mlp, nano, transformer, gpt2)
    """
    from .bench import _check_args
    from .build import resolve_device
    from .errors import InputError

    _check_args(resolve_device(device), models.split(","), precisions.split(","), peak_tflops=peak_tflops,
                resolve_pct=resolve_pct, budget_s=budget_s, threads=threads, quick=quick, rounds=rounds)
    if resolve_pct > 0 and not quick and not budget_s / processes > 0:  # (a share a float rounds to 0: refused)
        raise InputError(f"bench: --budget {budget_s:g} shared by {processes} processes leaves none a second")
    child = child_args(device=device, models=models, precisions=precisions, steps=steps, rounds=rounds,
                       warmup=warmup, fused=fused, peers=peers, peak_tflops=peak_tflops, quick=quick,
                       resolve_pct=resolve_pct, budget_s=budget_s / processes, threads=threads, aa=aa, batch=batch)
    return run_across(processes, child, resolve=resolve_pct / 100 if resolve_pct > 0 and not quick else None,
                      as_json=as_json, quick=quick)
