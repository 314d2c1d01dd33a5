"""``ampguard compare RUN_DIR RUN_DIR ...``: several runs side by side, one table and one plot.

The lesson's exercise: train the same model with several clip thresholds (or precisions, or
learning rates) and compare. Each run folder is read the way ``ampguard report`` reads one: its
``config.yaml`` for the settings, its ``steps.csv`` replayed through a
:class:`~ampguard.monitor.RunMonitor` for the statistics (so the numbers are the run card's), and
its run card ``RUN.md`` for why it ended. The table has one column per run; ``--out PNG`` draws
the runs over each other: loss, pre-clip gradient norm (with each ``max_norm``), log2 of the
loss scale and the rolling skip rate.

Diagnostics only: nothing here is imported by the training step. Everything is read and checked
before anything is written; ``--out`` is a ``.png`` in an existing folder (a plot ampguard drew
there, which carries its mark, is drawn again, as ``report`` does; any other existing file, a PNG
included, or a run folder's own ``report.png``, is never overwritten).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .build import build_monitor
from .errors import ExitCode, InputError, failed_because, first_line, table_cell
from .errors import shown as shown_path
from .files import temporary_beside
from .monitor import RunMonitor
from .report import (LoggedEvents, _linear_y, check_plot_path, cut_short, dots, drawn_by_ampguard, ended_at, log_y,
                     finite_points, gapped_line, import_matplotlib, judged_at_end, new_figure, panel_title, plot_metadata,
                     policy_changes_of, read_card, read_held_out, reading_notes, replay, rollbacks_of, rolling_skip_rate,
                     scale_restarts, segment_ends, shown, threshold_by_step, threshold_line, threshold_text, whole_steps)
from .run_folder import RunPaths
from .signals import console_width
from .sinks import Row, read_steps_and_columns

if TYPE_CHECKING:
    from .config import Config

FIGSIZE = (12.0, 11.0)  # inches
DPI = 100  # -> a 1200 x 1100 pixel PNG


@dataclass
class RunSummary:
    """One run folder, read back: its settings, its rows, the statistics replayed from them
    (held-out metrics included: the CSV's extra columns, fed to ``monitor.observe_eval``), and
    why it ended (from the run card)."""

    name: str
    path: Path
    config: Config
    rows: list[Row]
    monitor: RunMonitor
    ended: str
    notes: list[str] = field(default_factory=list)  # what reading its steps.csv left out or found missing
    card: dict[str, str] = field(default_factory=dict)  # the run card's rows (report.read_card)
    policy: list[dict[str, Any]] = field(default_factory=list)  # its policy changes on resume (policy_changes_of)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # its rollbacks (rollbacks_of)


def _card(card: Path) -> tuple[str, dict[str, str]]:
    """Why the run ended and the card's rows (:func:`~ampguard.report.read_card`, one read); a
    card that cannot be read is one line."""
    try:
        return read_card(card)
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"compare: {card}: cannot read the run card ({err})") from None


def load_run(path: str | Path) -> RunSummary:
    """Read one run folder (``steps.csv``, ``RUN.md``, ``config.yaml``); anything missing or
    malformed is an :class:`InputError` naming the folder and the file.

    Example::

        >>> try:
        ...     load_run("no/such/run")
        ... except InputError as err:
        ...     print(err)
        compare: no such folder no/such/run
    """
    from .config import read_run_config

    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"compare: {folder} is not a folder" if folder.exists()
                         else f"compare: no such folder {folder}")
    writer = RunPaths.existing(folder).writer_named()
    if writer is not None:  # (its card is from before this process began: the table would mix it with live rows)
        raise InputError(f"compare: {folder} is being written by another process ({writer}); compare it once "
                         "that run ends")
    for name, what in (("steps.csv", "per-step CSV"), ("RUN.md", "run card"), ("config.yaml", "config")):
        if not (folder / name).is_file():
            hint = " (a run still going, or one killed before its end: `ampguard train --resume` finishes it)" \
                if name == "RUN.md" else ""
            raise InputError(f"compare: {folder} has no {what} {name}; is it a run folder?{hint}")
    try:
        config = read_run_config(folder / "config.yaml")
    except InputError as err:  # ConfigError included (it names the file)
        raise InputError(f"compare: {err}") from None
    torn: list[str] = []
    try:
        rows, extra = read_steps_and_columns(folder / "steps.csv", torn)
    except InputError as err:  # (every line of compare's says it is compare's: review 47b)
        raise InputError(f"compare: {err}") from None
    if not rows:
        raise InputError(f"compare: {folder / 'steps.csv'} has no steps, nothing to compare")
    ended, card = _card(folder / "RUN.md")
    scaler_on = config.scaler_on
    # the run's own monitor, under the thresholds each step ran with (a resume may have changed them)
    log = LoggedEvents(folder)  # (read once: one history for the replay and its notes)
    policy, rollbacks = policy_changes_of(log), rollbacks_of(log)
    held = read_held_out(folder / "steps.csv", rows, extra)  # (once: the replay's metrics and the notes')
    # rows that stop before the step the run ended at, judged whole there, are not its end (review 52c): said
    end = ended_at(folder / "RUN.md", log) if judged_at_end(ended) else None
    whole = judged_at_end(ended) and not cut_short(rows, torn, end)
    monitor = replay(rows, build_monitor(config, scaler_enabled=scaler_on), policy=policy,
                     rollbacks=rollbacks, metrics=held.metrics, finished=whole, ends=segment_ends(log),
                     scales=scale_restarts(log, rows, config.scaler.init_scale) if scaler_on else None)
    notes = reading_notes(folder / "steps.csv", rows, torn, log, extra, config, policy, held=held, ended=end)
    return RunSummary(shown(folder.name), folder, config, rows, monitor, ended, notes, card, policy, rollbacks)


def load_runs(paths: Sequence[str | Path]) -> list[RunSummary]:
    """Every run, checked: at least two (a single ``str`` or path, a sequence of characters to
    Python, is one), none given twice. Runs that share a folder name are named by the path given.

    Example::

        >>> for paths in (["runs/a"], "runs/a"):
        ...     try:
        ...         load_runs(paths)
        ...     except InputError as err:
        ...         print(err)
        compare: needs at least two run folders, got 1
        compare: needs at least two run folders, got one: runs/a
    """
    if isinstance(paths, (str, bytes, os.PathLike)):  # (a str is a sequence: read as folders r, u, n; review 53b)
        raise InputError(f"compare: needs at least two run folders, got one: {shown_path(paths)}")
    if len(paths) < 2:
        raise InputError(f"compare: needs at least two run folders, got {len(paths)}")
    seen: dict[Path, str] = {}
    for p in paths:
        try:
            key = Path(p).resolve()
        except (RuntimeError, OSError) as err:  # (a symlink loop: RuntimeError before Python 3.13)
            raise InputError(f"compare: {p}: cannot resolve it ({first_line(err)})") from None
        if key in seen:
            raise InputError(f"compare: {p} is given twice (as {seen[key]})" if seen[key] != str(p)
                             else f"compare: {p} is given twice")
        seen[key] = str(p)
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for run, given in zip(runs, paths):
        if names.count(run.name) > 1:
            run.name = shown(str(given))
    return runs


# ---------------------------------------------------------------------------- the table


def _g(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None or math.isnan(x) else format(x, spec)


def task_of(config: Config) -> str:
    """The task a run trained, in a few words: the built-in's name (and preset) or the factory.

    Example::

        >>> from ampguard.config import validate
        >>> task_of(validate({})), task_of(validate({"task": {"preset": "gpt2-small"}}))
        ('charlm', 'charlm gpt2-small')
    """
    task = config.task
    return task.factory or task.name + (f" {task.preset}" if task.preset else "")


def table_rows(run: RunSummary) -> list[tuple[str, str]]:
    """The run's column of the table, as (row name, cell) pairs.

    Example (hand-made rows: 2 applied steps, 1 skipped)::

        >>> from ampguard.config import Config
        >>> rows = [Row(1, 0.1, 2.0, 1.0, 0.5, False, "", 1024.0), Row(2, 0.1, 0.5, 0.5, 0.3, False, "", 1024.0),
        ...         Row(3, 0.1, float("inf"), None, 0.4, True, "non_finite_grad", 512.0)]
        >>> monitor = replay(rows, window=10, init_scale=1024.0)
        >>> run = RunSummary("a", Path("a"), Config(), rows, monitor, "finished: 3 steps", card={"processes": "1"})
        >>> for key, cell in table_rows(run):
        ...     print(f"{key}: {cell}")
        ended: finished: 3 steps
        task: charlm
        precision: bf16
        processes: 1
        max_norm: 1
        steps / updates: 3 / 2
        skips: 1 (non_finite_grad=1)
        max rolling skip rate: 0.3333
        clip rate: 0.333
        scale health: stable (final 512)
        loss final / best: 0.3 / 0.3
    """
    m, c = run.monitor, run.config
    steps = [r.step for r in run.rows]
    clips = threshold_by_step(steps, "max_norm", c.max_norm, run.policy)  # (a resume may have changed it)
    scale = m.last.get("scaler_scale")
    cells = [
        ("ended", run.ended),
        # which layers trained in float8 (two fp8 runs may differ there alone), and on how many
        # processes (task.batch_size is per process): from the run card, "-" for an older card
        ("task", task_of(c)),
        ("precision", c.precision + (f" ({run.card['fp8']})" if "fp8" in run.card else "")),
        ("processes", run.card.get("processes", "-")),
        ("max_norm", threshold_text(steps, clips)),
        ("steps / updates", f"{m.steps} / {m.updates}"),
        ("skips", f"{sum(m.skips.values())} ({m.skips_text()})"),
        ("max rolling skip rate", f"{m.max_rolling_skip_rate:.4f}" + (
            f" (judged {m.max_skip_rate:.4f})" if f"{m.max_skip_rate:.4f}" != f"{m.max_rolling_skip_rate:.4f}" else "")),
        ("clip rate", f"{m.clip_rate:.3f}" if any(clips) else "n/a"),
        ("scale health", m.scale_verdict + (f" (final {_g(scale, 'g')})" if m.scaler_enabled else "")),
        *((("headroom alerts", run.card["headroom alerts"]),) if "headroom alerts" in run.card else ()),
        ("loss final / best", f"{_g(m.final_loss_and_step[0])} / {_g(m.best_loss)}"),
    ]
    cells += [(f"{name} final / best", f"{_g(m.eval_last.get(name))} / {_g(m.eval_best.get(name))}")
              for name in {**m.eval_last, **m.eval_best}]
    return cells


def format_table(runs: Sequence[RunSummary], encoding: str | None = None) -> str:
    """One Markdown table, a row per quantity and a column per run (padded to line up in a
    terminal of ``encoding``, the console's when None: a run's name an ASCII console escapes
    is padded as escaped; a ``|`` or a control character in a cell escaped, as validate's tables
    do). A held-out metric one run lacks is ``-`` there.

    Example::

        >>> from ampguard.config import Config
        >>> rows = [Row(1, 0.1, 2.0, 1.0, 0.5, False, "", 1.0)]
        >>> runs = [RunSummary(n, Path(n), Config(), rows, replay(rows, scaler_enabled=False), "finished: 1 steps")
        ...         for n in ("clip-0.5", "clip-5")]
        >>> print(format_table(runs).splitlines()[0])
        |                       | clip-0.5                 | clip-5                   |
    """
    columns = [dict(table_rows(r)) for r in runs]
    keys: list[str] = []
    for col in columns:
        keys += [k for k in col if k not in keys]
    lines = [["", *(r.name for r in runs)], *([k, *(col.get(k, "-") for col in columns)] for k in keys)]
    lines = [[table_cell(cell) for cell in line] for line in lines]  # (a `|` or a newline in a run's name: review 53b)
    widths = [max(console_width(line[i], encoding) for line in lines) for i in range(len(lines[0]))]

    def fmt(cells: list[str]) -> str:
        return "| " + " | ".join(cell + " " * (w - console_width(cell, encoding)) for cell, w in zip(cells, widths)) + " |"

    return "\n".join([fmt(lines[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(fmt, lines[1:])])


# ---------------------------------------------------------------------------- the plot


FEW_RUNS = 4  # up to this many, a legend in each panel and the runs' names in the title


def run_colours(n: int) -> list[tuple[float, ...]]:
    """``n`` colours, one per run, none repeated: matplotlib's ``tab10`` up to 10 runs (the
    default cycle's colours), ``tab20`` up to 20, beyond that evenly spaced over ``turbo``.

    Example::

        >>> len(set(run_colours(12))), len(set(run_colours(30)))
        (12, 30)
    """
    import matplotlib

    if n <= 20:
        cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
        return [cmap(i) for i in range(n)]
    return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]


def plot_overlay(runs: Sequence[RunSummary], png: str | Path) -> Path:
    """Draw the runs over each other (1200 x 1100 px, four panels on a shared step axis): loss,
    pre-clip global norm with each run's ``max_norm``, log2 of the loss scale, rolling skip rate.
    Skipped steps are marked with an ``x`` on the loss panel. The PNG carries ampguard's mark
    (:func:`~ampguard.report.plot_metadata`). Written beside the target, then renamed over an
    earlier plot or, where there is none, linked into place (a link fails where a file appeared
    meanwhile: that one is never replaced), so a failed write leaves no half a PNG and an earlier
    plot stays as it was (an existing file that is no plot ampguard drew is refused before,
    :func:`~ampguard.report.check_plot_path`, and again here should one appear at ``png`` while the
    runs were drawn). Losses of both signs beyond :data:`~ampguard.report.LINEAR_LIMIT` (-1e308
    and 1e308 in an edited CSV) put the loss panel on a symmetric log axis; values matplotlib still
    cannot lay an axis out for are an :class:`InputError`, with nothing written.
    """
    import_matplotlib()
    with warnings.catch_warnings():  # (numpy's overflow notes on values near the float maximum)
        warnings.simplefilter("ignore", RuntimeWarning)
        return _plot_overlay(runs, png)


def _plot_overlay(runs: Sequence[RunSummary], png: str | Path) -> Path:
    png = Path(png)
    fig, axes = new_figure(4, FIGSIZE, DPI, layout="constrained")
    ax_loss, ax_norm, ax_scale, ax_skip = axes
    colours, few = run_colours(len(runs)), len(runs) <= FEW_RUNS
    log_loss, top_rate, losses, handles = True, 0.0, [], []
    for colour, run in zip(colours, runs):
        rows = run.rows
        xs, ys = finite_points(rows, [r.loss for r in rows])
        log_loss = log_loss and (not ys or min(ys) > 0)  # (a run with no finite loss has no say)
        losses += ys
        label = run.name if ys else f"{run.name} (no finite loss)"  # (nothing of it on this panel: said why)
        gx, gy, lone = gapped_line([r.step for r in rows], [r.loss for r in rows])  # (a gap at a non-finite loss)
        handles += ax_loss.plot(gx, gy, lw=1, color=colour, label=label, **lone)
        # a skipped step at its loss; a non-finite loss at the last finite one (before the first: at the first)
        marks, last = [], ys[0] if ys else None
        for r in rows:
            last = r.loss if r.loss is not None and math.isfinite(r.loss) else last
            if r.skipped and last is not None:
                marks.append((r.step, last))
        if marks:
            ax_loss.plot([s for s, _ in marks], [y for _, y in marks], "x", color=colour, ms=5)
        xs, ys, lone = gapped_line([r.step for r in rows], [r.grad_l2_pre_clip for r in rows], positive=True)
        ax_norm.plot(xs, ys, lw=1, color=colour, label=run.name, **lone)
        steps = [r.step for r in rows]
        threshold_line(ax_norm, steps, threshold_by_step(steps, "max_norm", run.config.max_norm, run.policy),
                       f"{run.name}: max_norm", color=colour, ls="--", lw=1)
        xs, ys = finite_points(rows, [r.scaler_scale for r in rows], positive=True)
        ax_scale.step(xs, [math.log2(v) for v in ys], where="post", lw=1.2, color=colour, label=run.name, **dots(xs))
        rates = rolling_skip_rate(rows, run.config.monitor.window, run.rollbacks, run.config.monitor.min_steps,
                                  run.policy)  # (review 54k: a rollback's young window, as the run judged it)
        top_rate = max(top_rate, *rates)
        ax_skip.plot([r.step for r in rows], rates, lw=1.2, color=colour,
                     label=f"{run.name} (window {run.config.monitor.window})", **dots(rows))
    if log_loss and losses:
        log_y(ax_loss, "loss (log)")
    else:  # linear, or symmetric log for losses of both signs near the float maximum
        _linear_y(ax_loss, losses, "loss")
    panel_title(ax_loss, "Loss (x: a skipped step)")
    log_y(ax_norm, "gradient norm (log)")
    panel_title(ax_norm, "Global gradient L2 norm before clipping (dashed: each run's max_norm)")
    ax_scale.set_ylabel("log2(loss scale)")
    panel_title(ax_scale, "Loss scale after each step's update (0 = 1.0: no scaler)")
    ax_skip.set_ylim(0, max(0.1, top_rate * 1.2))
    ax_skip.set_ylabel("skip rate")
    panel_title(ax_skip, "Rolling skip rate (over the steps each run's window holds)")
    ax_skip.set_xlabel("step (optimizer steps, not micro-batches)")
    whole_steps(ax_skip)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if few:
            ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    title = (f"ampguard compare: {', '.join(r.name for r in runs)}" if few
             else f"ampguard compare: {len(runs)} runs")
    fig.suptitle(title, fontsize=13)
    if not few:  # one legend of the runs beside the panels: four in the panels would cover the curves
        fig.legend(handles, [r.name for r in runs], loc="outside right upper", fontsize=8,
                   ncols=math.ceil(len(runs) / 40))
    try:
        with temporary_beside(png) as partial:
            # marked as ampguard's (report.PLOT_MARK): only a plot with the mark is ever drawn again
            fig.savefig(partial, dpi=DPI, format="png", metadata=plot_metadata(title))
            if png.exists() or png.is_symlink():  # an earlier plot: drawn again, if it still is one
                if png.is_symlink() or not drawn_by_ampguard(png):
                    raise InputError(f"compare: --out {png} exists and is not a plot ampguard drew; refusing to "
                                     "overwrite it")
                os.replace(partial, png)
            else:
                os.link(partial, png)  # fails if something appeared there meanwhile: never replaced
    except FileExistsError:
        raise InputError(f"compare: --out {png} already exists; refusing to overwrite it") from None
    except OSError as err:
        raise InputError(f"compare: --out {png}: cannot write the plot ({failed_because(err)})") from None
    except (ValueError, OverflowError) as err:  # matplotlib's axes: values spanning more than a float holds
        raise InputError(f"compare: --out {png}: cannot draw these runs' values (a steps.csv value too large "
                         f"to plot, such as losses of -1e308 and 1e308?): {first_line(err, with_type=True)}") from None
    return png


# ---------------------------------------------------------------------------- the verb


def run(paths: Sequence[str | Path], *, out: str | Path | None = None) -> ExitCode:
    """``ampguard compare RUN_DIR RUN_DIR ... [--out PNG]``: print the table (and draw the plot).

    Example (two hand-made run folders)::

        >>> import shutil, tempfile
        >>> from ampguard.config import dump_config, validate
        >>> from ampguard.sinks import CSV_COLUMNS
        >>> root = Path(tempfile.mkdtemp())
        >>> config = dump_config(validate({"precision": "fp16", "scaler": {"init_scale": 1024}}))
        >>> for name, cells in (("a", "2.0,1.0,0.5,0,,1024.0"), ("b", "inf,,0.5,1,non_finite_grad,512.0")):
        ...     (root / name).mkdir()
        ...     _ = (root / name / "config.yaml").write_text(config)
        ...     _ = (root / name / "RUN.md").write_text(f"# Run {name}\\n\\n**finished: 1 step**\\n")
        ...     _ = (root / name / "steps.csv").write_text(",".join(CSV_COLUMNS) + f"\\n1,0.1,{cells}\\n")
        ...     _ = (root / name / "events.jsonl").write_text("")
        >>> run([root / "a", root / "b"])
        |                       | a                   | b                     |
        |-----------------------|---------------------|-----------------------|
        | ended                 | finished: 1 step    | finished: 1 step      |
        | task                  | charlm              | charlm                |
        | precision             | fp16                | fp16                  |
        | processes             | -                   | -                     |
        | max_norm              | 1                   | 1                     |
        | steps / updates       | 1 / 1               | 1 / 0                 |
        | skips                 | 0 (none)            | 1 (non_finite_grad=1) |
        | max rolling skip rate | 0.0000              | 1.0000                |
        | clip rate             | 1.000               | 0.000                 |
        | scale health          | stable (final 1024) | warming (final 512)   |
        | loss final / best     | 0.5 / 0.5           | - / -                 |
        <ExitCode.OK: 0>
        >>> shutil.rmtree(root)
    """
    png = Path(out) if out is not None else None
    if png is not None:  # (a run folder's own report.png included: that run's to draw, never compare's)
        check_plot_path(png, None, verb="compare")
    runs = load_runs(paths)
    if png is not None:
        plot_overlay(runs, png)
    for run in runs:
        for note in run.notes:
            print(f"note: {note}")
    tasks = dict.fromkeys(task_of(run.config) for run in runs)
    if len(tasks) > 1:  # (side by side all the same: the table's task row says which is which)
        print(f"note: these runs trained different tasks ({', '.join(tasks)}): their losses and held-out metrics "
              "are not comparable")
    print(format_table(runs))
    if png is not None:
        print(f"plot: {png}")
    return ExitCode.OK
