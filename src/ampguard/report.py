"""After the run: read a per-step CSV back, draw the one-page plot, write the run card.

Diagnostics only: nothing here is imported by the training step.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import math
import re
import os
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from .build import build_monitor
from .clipping import clip_threshold
from .errors import (AmpguardWarning, ExitCode, InputError, check_folder_of, counted, failed_because, first_line,
                     real_number, table_cell, visible, whole_number, warn)
from .files import DiskFull, left_by_an_ended_process, remove_temporaries, replace_atomically, temporary_beside
from .fp8 import in_float8
from .headroom import HEADROOM_CSV, HeadroomRow, bits_shown, read_headroom_csv
from .monitor import AT_THE_END, DEFAULT_MIN_STEPS, THRESHOLDS, RollingWindow, RunMonitor, ScaleHealth
from .precision import Precision, backend_text, finite_number
from .records import SKIP_REASONS
from .run_folder import RunPaths
from .sinks import Row, StepColumns, csv_number, metric_values, read_step_columns, read_steps_and_columns
from .watch import float32_layers_text

if TYPE_CHECKING:
    import torch

    from .config import Config
    from .run_folder import RunResult

REASON_COLOURS = {"non_finite_grad": "tab:orange", "non_finite_loss": "tab:red"}
FIGSIZE = (12.0, 14.0)  # inches
DPI = 100  # -> a 1200 x 1400 pixel PNG
PANEL_MARGINS = {"left": 0.075, "right": 0.98, "top": 0.94, "bottom": 0.04, "hspace": 0.2}
"""The five panels' place in the figure when no heatmap is drawn (fractions of the figure)."""
HEATMAP_HEIGHT = 5.0  # inches added for the headroom heatmap, when the run recorded headroom


def panel_title(ax: Any, text: str) -> None:
    """A panel's title, just above it. Placed there rather than by matplotlib, which at each draw
    measures every tick label of the y axis to see whether its offset text (a "1e-4" at the
    top-left) reaches the centred title, and never does on these wide panels: the same pixels,
    ~12% of a plot's time (0.635 -> 0.561 s)."""
    ax.set_title(text, y=1.0)


_SUPERSCRIPT = str.maketrans("0123456789-", "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b")
_MATHTEXT_LABEL = re.compile(r"\$\\mathdefault\{(-?)([^{}]*?)(?:\^\{(-?\d+)\})?\}\$")


def plain_log_label(label: str) -> str:
    """A log axis' tick label as plain text: matplotlib's ``$\\mathdefault{10^{-3}}$`` as ``10⁻³``,
    ``2\\times10^{1}`` as ``2×10¹``, a minus as U+2212 (what math text draws). Math text is parsed
    again for each figure (its cache belongs to a renderer): 8-9 labels a report, ~15% of its time
    (0.93 -> 0.80 s a plot); the same characters, drawn as text. A label of another form is kept.

    Example::

        >>> [plain_log_label(s) for s in (r"$\\mathdefault{10^{-3}}$", r"$\\mathdefault{2\\times10^{1}}$",
        ...                              r"$\\mathdefault{-10^{300}}$", r"$\\mathdefault{0}$", r"$\\mathdefault{0.5}$", "")]
        ['10⁻³', '2×10¹', '−10³⁰⁰', '0', '0.5', '']
    """
    match = _MATHTEXT_LABEL.fullmatch(label)
    if match is None:
        return label
    sign, body, power = match.groups()
    body = body.replace("\\times", "\u00d7")
    return ("\u2212" if sign else "") + body + (power.translate(_SUPERSCRIPT) if power is not None else "")


@functools.cache
def _plain_log_formatter() -> type:
    """matplotlib's formatter of a log axis' ticks, its labels through :func:`plain_log_label`
    (made once, as matplotlib is imported when a plot is drawn, not with this module)."""
    from matplotlib.ticker import LogFormatterSciNotation

    class PlainLogFormatter(LogFormatterSciNotation):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return plain_log_label(super().__call__(x, pos))

    return PlainLogFormatter


PLAIN_LABEL_GLYPHS = "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207b\u00d7\u2212"
"""What :func:`plain_log_label` writes beyond digits: the font the labels are drawn in must have each."""


def plain_labels_drawable() -> bool:
    """Whether the font matplotlib draws tick labels in (``font.family`` of its settings: a
    notebook's or a style's own) has every glyph of :data:`PLAIN_LABEL_GLYPHS`: matplotlib's
    DejaVu Sans does; Computer Modern (``cmr10``) or STIX would draw boxes, where math text drew
    the superscripts itself (review 60: then the log axes keep math text)."""
    from matplotlib import font_manager

    return _has_glyphs(font_manager.findfont(font_manager.FontProperties()))


@functools.cache
def _has_glyphs(path: str) -> bool:
    from matplotlib.ft2font import FT2Font

    font = FT2Font(path)
    return all(font.get_char_index(ord(c)) for c in PLAIN_LABEL_GLYPHS)


def log_y(ax: Any, label: str, scale: str = "log") -> None:
    """``ax``'s y axis on a ``scale`` ("log" or "symlog"), labelled ``label``: the formatters
    matplotlib's scale sets (base 10; a log axis labels its minor ticks where a decade is wide
    enough, a symlog axis none), their labels plain text (:func:`plain_log_label`) where the
    labels' font can draw them (:func:`plain_labels_drawable`), else math text as matplotlib
    writes them.

    Example::

        >>> fig, (a, b) = new_figure(2, FIGSIZE)
        >>> _ = a.plot([1, 2], [1e-3, 1e2]); log_y(a, "norm (log)"); fig.canvas.draw()
        >>> [t.get_text() for t in a.get_yticklabels() if t.get_text()][:3], a.get_ylabel()
        (['10⁻⁴', '10⁻³', '10⁻²'], 'norm (log)')
    """
    ax.set_yscale(scale)
    ax.set_ylabel(label)
    if not plain_labels_drawable():
        return
    formatter = _plain_log_formatter()
    ax.yaxis.set_major_formatter(formatter(10))
    if scale == "log":
        ax.yaxis.set_minor_formatter(formatter(10, labelOnlyBase=False))


_TENSOR_TEXT = re.compile(r"tensor\(\s*\[*\s*[-+]?(\d|\.\d|inf|nan)")
"""A cell that is a tensor's text (``str(t)`` of a metric: ``tensor(0.4100)``, ``tensor([0.41])``,
``tensor(0.41, device='cuda:0')``)."""


def held_out_metrics(csv_path: str | Path, extra: Sequence[Mapping[str, str]],
                     notes: list[str] | None = None, steps: Sequence[int] = ()) -> list[dict[str, float]]:
    """Each row's held-out metrics (empty where none was evaluated): the CSV's extra columns
    (``extra``, as :func:`~ampguard.sinks.read_steps_and_columns` read them) whose every cell
    reads as a number, as :func:`~ampguard.sinks.metric_values` reads them (the optimizer labels
    and empty cells left out). Any other column is text (a user's
    ``CsvSink(extra_columns=["phase", "commit", "precision"])``; DESIGN's "more may follow" sets
    no type), left out. A column that mixes numbers and text is left out too, and said in
    ``notes`` (a metric a hand edit or an export spoilt, ``n/a`` in ``val_accuracy``; or text
    that happens to read as a number, a short commit SHA ``2113e02``): no name tells the two
    apart (reviews 46b, 46d, 46e: a rule by name refused ``precision`` = ``16``/``bf16`` and
    ``error_code`` = ``137``/``OOM``, and let ``val_top1`` drop unsaid). ``compare`` and
    ``report`` read a CSV's metrics through this; what they draw and count never meets a cell of
    text. A column of text only is a user's and passes unsaid, unless every cell is a tensor's
    text (``tensor(0.4100)``: a metric written as ``str(t)``, review 47b), said in ``notes`` too.
    ``steps`` (each row's step) names the cell by its step; without, by its row.

    Example::

        >>> notes = []
        >>> held_out_metrics("s.csv", [{"val_loss": "0.5", "commit": "2113e02", "precision": "bf16"},
        ...                            {"val_loss": "", "commit": "6ba2a38", "precision": "bf16"}], notes)
        [{'val_loss': 0.5}, {}]
        >>> print(notes[0])
        s.csv: column commit holds numbers and text (its first text '6ba2a38', the cell of row 2; 1 of 2 cells numbers): read as text, left out
        >>> notes = []
        >>> held_out_metrics("s.csv", [{"val_top1": "tensor(0.4100)"}, {"val_top1": "tensor(0.5)"}], notes, steps=[10, 20])
        [{}, {}]
        >>> print(notes[0])
        s.csv: column val_top1 holds a tensor's text in every cell (the first 'tensor(0.4100)', at step 10): read as text, left out; write float(t) or t.item() there
    """
    def number(cell: str) -> bool:
        try:
            csv_number(cell, "", "")
        except InputError:
            return False
        return True

    names = extra[0] if extra else {}
    text = set()
    for name in names:
        cells = [(row, cells[name]) for row, cells in enumerate(extra, start=1) if cells.get(name)]
        read = [number(cell) for _, cell in cells]
        if all(read):
            continue
        text.add(name)
        row, first = next((row, cell) for (row, cell), ok in zip(cells, read) if not ok)
        at = f"at step {steps[row - 1]}" if len(steps) >= row else f"the cell of row {row}"
        if any(read) and notes is not None:
            notes.append(f"{csv_path}: column {name} holds numbers and text (its first text {first!r}, {at}; "
                         f"{sum(read)} of {len(read)} cells numbers): read as text, left out")
        elif notes is not None and all(_TENSOR_TEXT.match(cell) for _, cell in cells):
            notes.append(f"{csv_path}: column {name} holds a tensor's text in every cell (the first {first!r}, {at}): "
                         "read as text, left out; write float(t) or t.item() there")
    return [metric_values({k: v for k, v in cells.items() if k not in text}, str(csv_path)) for cells in extra]


class HeldOut(NamedTuple):
    """A CSV's held-out metrics as :func:`read_held_out` read them: each row's, and the notes the
    read made (columns of numbers and text, or of tensors' text, left out)."""

    metrics: list[dict[str, float]]
    notes: list[str]


def read_held_out(csv_path: str | Path, rows: Sequence[Row], extra: Sequence[Mapping[str, str]]) -> HeldOut:
    """:func:`held_out_metrics` of a CSV's ``rows`` and their ``extra`` cells, with its notes naming
    each cell by its step: read once, for the replay and for :func:`reading_notes` alike.

    Example::

        >>> rows = [Row(step, 0.1, 1.0, 1.0, 0.5, False, "", 1.0) for step in (7, 8)]
        >>> held = read_held_out("s.csv", rows, [{"val_acc": "0.5"}, {"val_acc": "n/a"}])
        >>> held.metrics
        [{}, {}]
        >>> print(held.notes[0])
        s.csv: column val_acc holds numbers and text (its first text 'n/a', at step 8; 1 of 2 cells numbers): read as text, left out
    """
    notes: list[str] = []
    return HeldOut(held_out_metrics(csv_path, extra, notes, [r.step for r in rows]), notes)


def reading_notes(csv_path: Path, rows: list[Row], torn: list[str], run_dir: Path | LoggedEvents | None = None,
                  extra: Sequence[Mapping[str, str]] = (), config: Config | None = None,
                  policy: Sequence[dict[str, Any]] = (), unobserved: int = 0,
                  held: HeldOut | None = None, ended: tuple[int, str] | None = None) -> list[str]:
    """What reading ``csv_path`` left out or found missing, a note each: its last line ``torn`` (a
    write cut short), the steps with no row before its last (a line deleted by hand, a CSV a
    loop began at a later step; not the ``unobserved`` ones, :func:`unobserved_of`: said apart): the figures count the rows there are; with the run's ``config``,
    rows past its ``steps`` (rows the run did not write, added by hand); rows missing at the end of a
    run that ``ended`` judged whole at a later step (:func:`ended_at`: the step, and what says so);
    values a run can hold
    but no guard writes (:func:`value_notes`, with the rows' ``extra`` cells and, with ``config``,
    the ``max_norm`` each step ran under, as ``policy`` changed it); and, for the ``run_dir`` it
    belongs to, a missing ``events.jsonl`` (the replay then knows of no policy change and no
    rollback).

    Example::

        >>> rows = [Row(s, 0.1, 2.0, 1.0, 0.5, False, "", 1.0) for s in (1, 2, 4, 5, 9)]
        >>> for note in reading_notes(Path("steps.csv"), rows, ["10,0.1,2.0"]):
        ...     print(note)
        the last line of steps.csv is torn (no newline: a write cut short), left out: '10,0.1,2.0'
        steps.csv has no row for 4 of its steps (3, 6-8): its figures are of the 5 rows it has (a rate over the run's steps counts the missing ones as neither skipped nor clipped)
        >>> reading_notes(Path("steps.csv"), rows[2:4], [], unobserved=3)  # (a Trainer's resume: 1-3 not observed)
        []
        >>> reading_notes(Path("steps.csv"), rows[:2], [], ended=(30, "its card"))
        ['steps.csv ends at step 2, the run ended at step 30 (its card): steps 3-30 have no row']
    """
    notes = [f"the last line of {csv_path} is torn (no newline: a write cut short), left out: {torn[0][:40]!r}"
             ] if torn else []
    gaps, before = [], unobserved
    for row in rows:
        if row.step > before + 1:
            gaps.append((before + 1, row.step - 1))
        before = max(before, row.step)
    if gaps:
        missing = sum(last - first + 1 for first, last in gaps)
        said = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:5]) + (", ..." if len(gaps) > 5 else "")
        notes.append(f"{csv_path} has no row for {missing} of its steps ({said}): its figures are of the "
                     f"{counted(len(rows), 'row')} it has (a rate over the run's steps counts the missing ones as "
                     "neither skipped nor clipped)")
    if cut_short(rows, torn, ended):  # (review 52c: a CSV cut at its end was unsaid)
        tail = f"step {ended[0]} has" if rows[-1].step + 1 == ended[0] else \
            f"steps {rows[-1].step + 1}-{ended[0]} have"
        notes.append(f"{csv_path} ends at step {rows[-1].step}, the run ended at step {ended[0]} ({ended[1]}): "
                     f"{tail} no row")
    steps, max_norms = (None, None) if config is None else (
        config.steps, threshold_by_step([r.step for r in rows], "max_norm", config.max_norm, policy))
    past = [row.step for row in rows if steps is not None and row.step > steps]
    if past:  # (its final loss read from a row the run never wrote, unsaid)
        notes.append(f"{csv_path} has {counted(len(past), 'row')} past the run's {steps} steps (steps {past[0]}"
                     f"{'' if len(past) == 1 else f'-{past[-1]}'}: not the run's own; added by hand?): its figures "
                     "count them")
    notes += value_notes(csv_path, rows, extra, max_norms, own=config is not None, held=held)
    log = LoggedEvents.of(run_dir) if run_dir is not None else None
    if log is None:
        return notes
    if not (log.dir / "events.jsonl").exists():
        notes.append(f"{log.dir} has no events.jsonl: replayed as if no setting changed on resume and no rollback "
                     "happened")
        return notes
    if damaged := log.unreadable():  # (review 52c: a damaged line inside the log was passed over unsaid)
        first = f"line {damaged[0]}" if len(damaged) == 1 else f"the first at line {damaged[0]}"
        notes.append(f"{log.dir / 'events.jsonl'} has {counted(len(damaged), 'unreadable line')} ({first}): the "
                     f"rollbacks, resumes and policy changes {'it' if len(damaged) == 1 else 'they'} held are not "
                     "replayed")
    if unread := log.kept(lambda event: event.get("event") == "rollback" and not
                          whole_number(event.get("updates_undone")), at_resume=True):
        notes.append(f"{log.dir / 'events.jsonl'} has {counted(len(unread), 'rollback')} with no count of the "
                     f"updates it undid (step {unread[0].get('step')}: updates_undone "
                     f"{unread[0].get('updates_undone')!r}): passed over, its updates counted as applied")
    return notes


def value_notes(csv_path: Path, rows: list[Row], extra: Sequence[Mapping[str, str]] = (),
                max_norms: Sequence[float | None] | None = None, own: bool = False,
                held: HeldOut | None = None) -> list[str]:
    """A note for each kind of value a row can hold but no guard of ampguard's writes, read as
    written: a learning rate below 0 or not finite (a schedule of one's own), an infinite loss
    scale (a torch GradScaler's past float32's largest: ampguard's stops there), an applied
    step's post-clip norm above the ``max_norms`` it ran under (one per row: the clip caps it), an
    ``*accuracy`` metric in ``extra`` (the rows' cells after the fixed eight) outside [0, 1] (a
    percentage?), a column of numbers and text (:func:`held_out_metrics`: left out); with ``own``
    (the rows of a run ampguard wrote: its ``config.yaml`` beside them), an applied step with an
    empty ``lr``, ``loss`` or ``scaler_scale`` cell, which every applied row of its holds (a
    stock Trainer's CSV leaves the loss empty by design: not said there). What no run
    can write at all (a non-finite loss on an applied step, a post-clip
    norm above the pre-clip one) :func:`~ampguard.sinks.read_steps_and_columns` refuses.

    Example::

        >>> rows = [Row(1, 0.1, 2.0, 1.0, 0.5, False, "", 1.0), Row(2, -5.0, 2.0, 2.0, 0.5, False, "", math.inf)]
        >>> for note in value_notes(Path("steps.csv"), rows, [{"val_accuracy": "0.5"}, {"val_accuracy": "70"}],
        ...                         max_norms=[1.0, 1.0]):
        ...     print(note)
        steps.csv has 1 row with a learning rate below 0 or not finite (step 2: -5.0): read as written
        steps.csv has 1 row with an infinite loss scale, which ampguard's scaler never grows to (step 2): read as written
        steps.csv has 1 applied step whose post-clip norm is above the max_norm it ran under (step 2: 2.0 > 1): read as written
        steps.csv has 1 row whose val_accuracy is outside [0, 1] (step 2: 70; a percentage?): read as written
    """
    def said(found: list[tuple[int, str]], noun: str, what: str, hint: str = "") -> list[str]:
        if not found:
            return []
        (step, value), more = found[0], f", the first of {len(found)}" if len(found) > 1 else ""
        return [f"{csv_path} has {counted(len(found), noun)} {what} (step {step}{f': {value}' if value else ''}{hint}"
                f"{more}): read as written"]

    notes = said([(r.step, repr(r.lr)) for r in rows if r.lr is not None and not 0 <= r.lr < math.inf],
                 "row", "with a learning rate below 0 or not finite")
    notes += said([(r.step, "") for r in rows if r.scaler_scale == math.inf],
                  "row", "with an infinite loss scale, which ampguard's scaler never grows to")
    if max_norms is not None:  # (the clip caps an applied step's norm at float32's max_norm: a tolerance for it)
        notes += said([(r.step, f"{r.grad_l2_post_clip!r} > {cap:g}") for r, cap in zip(rows, max_norms)
                       if not r.skipped and cap is not None and r.grad_l2_post_clip is not None
                       and r.grad_l2_post_clip > cap * (1 + 2**-20)],
                      "applied step", "whose post-clip norm is above the max_norm it ran under")
    if own:
        notes += said([(r.step, ", ".join(c for c, v in (("lr", r.lr), ("loss", r.loss), ("scaler_scale", r.scaler_scale))
                                         if v is None)) for r in rows
                       if not r.skipped and None in (r.lr, r.loss, r.scaler_scale)],
                      "applied step", "with an empty cell, which every applied row of an ampguard run holds (a hand "
                      "edit?)")
    held = read_held_out(csv_path, rows, extra) if held is None else held  # (a caller's read: not again)
    notes += held.notes  # (a column of text: said, left out)
    metrics = held.metrics
    for name in sorted({name for values in metrics for name in values if name.endswith("accuracy")}):
        notes += said([(r.step, repr(value)) for r, values in zip(rows, metrics)
                       if (value := values.get(name)) is not None and not 0 <= value <= 1],
                      "row", f"whose {name} is outside [0, 1]", "; a percentage?")
    return notes


def dots(xs: Sequence[Any]) -> dict[str, Any]:
    """The keyword arguments that make a series of one point visible: a line through a single
    point draws nothing (a run of one step, a run killed after its first).

    Example::

        >>> dots([1]), dots([1, 2])
        ({'marker': 'o', 'ms': 4}, {})
    """
    return {"marker": "o", "ms": 4} if len(xs) == 1 else {}


def gapped_line(steps: Any, values: Any, positive: bool = False) -> tuple[Any, Any, dict[str, Any]]:
    """The points of a line with a gap at each value that is not finite (or not > 0 with
    ``positive``: a log axis), :func:`thinned`, and the keyword arguments that dot its lone points
    (:func:`lone_dots`). Dropping those values instead drew a segment from the step before to the
    one after, read as a finite value at a skipped step whose norm was inf (review 61c); the skip's
    own mark says why the line stops.

    Example (step 2's norm was inf, step 3's empty: step 1 stands alone)::

        >>> xs, ys, marks = gapped_line([1, 2, 3, 4, 5], [2.0, float("inf"), None, 0.5, 0.4], positive=True)
        >>> xs.tolist(), ys.tolist(), marks
        ([1, 2, 3, 4, 5], [2.0, nan, nan, 0.5, 0.4], {'marker': 'o', 'ms': 3, 'markevery': [0]})
    """
    import numpy as np

    steps, values = np.asarray(steps), np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        keep = np.isfinite(values) & (values > 0) if positive else np.isfinite(values)
    xs, ys = thinned(steps, np.where(keep, values, np.nan))
    return xs, ys, lone_dots(ys)


def lone_dots(ys: Any) -> dict[str, Any]:
    """The keyword arguments that make each lone point of a line with gaps visible (a finite value
    whose neighbours are not: a line through it draws nothing), as :func:`dots` does for a line of
    one point.

    Example (steps 1, 3 and 5 finite, 2 and 4 gaps; 5 and 6 a segment)::

        >>> import numpy as np
        >>> lone_dots(np.array([1.0, np.nan, 2.0, np.nan, 3.0, 4.0])), lone_dots(np.array([1.0, 2.0]))
        ({'marker': 'o', 'ms': 3, 'markevery': [0, 2]}, {})
    """
    import numpy as np

    ok = np.isfinite(ys)
    before = np.concatenate([[False], ok[:-1]])
    after = np.concatenate([ok[1:], [False]])
    lone = np.flatnonzero(ok & ~before & ~after)
    return {"marker": "o", "ms": 3, "markevery": lone.tolist()} if len(lone) else {}


def whole_steps(ax: Any) -> None:
    """The x axis of steps ticks whole numbers only (a short run's axis read 2.5, 7.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def finite_points(rows: list[Row], values: list[float | None], positive: bool = False
                  ) -> tuple[list[int], list[float]]:
    """The (steps, values) a plot draws: the finite values (and > 0 with ``positive``).

    Example::

        >>> rows = [Row(s, 0.1, 2.0, 1.0, 0.5, False, "", 1.0) for s in (1, 2, 3)]
        >>> finite_points(rows, [1.0, float("nan"), 0.0], positive=True)
        ([1], [1.0])
    """
    pairs = [(r.step, v) for r, v in zip(rows, values) if v is not None and math.isfinite(v) and (v > 0 or not positive)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def rolling_skip_rate(rows: Sequence[Row] | StepColumns, window: int, rollbacks: Sequence[dict[str, Any]] = (),
                      min_steps: int = DEFAULT_MIN_STEPS, policy: Sequence[dict[str, Any]] = ()) -> list[float]:
    """The rolling skip rate at each row, as the run judged it (:attr:`RunMonitor.skip_rate`):
    over the steps the window holds, the window emptied after the step of each of ``rollbacks``
    (:func:`rollbacks_of`), as the run's monitor emptied it (the skips that made a skip-guard
    rollback are not judged again), and the window so restarted counting its skips over
    ``min(min_steps, window)`` steps until it holds that many (``min_steps`` as each step ran
    under it: ``policy``, :func:`policy_changes_of`; review 54k: the plot drew 1 of 1 for one
    skip after a rollback, the guards 1/min_steps).

    Example::

        >>> rows = [Row(s, 0.1, 2.0, 1.0, 0.5, s == 3, "", 1.0) for s in (1, 2, 3, 4)]
        >>> rolling_skip_rate(rows, window=2)
        [0.0, 0.0, 0.5, 0.5]
        >>> rolling_skip_rate(rows, window=10, rollbacks=[{"step": 2, "updates_undone": 1}], min_steps=3)  # (1/3, not 1/1, 1/2)
        [0.0, 0.0, 0.3333333333333333, 0.3333333333333333]
    """
    restarts = {r["step"] for r in rollbacks}
    win, rates = RollingWindow(window), []
    pairs = (zip(map(int, rows.steps), map(bool, rows.skipped)) if isinstance(rows, StepColumns)  # (a plot's)
             else ((r.step, r.skipped) for r in rows))
    settled = min(min_steps, window) if not any(c["key"] == "monitor.min_steps" for c in policy) else None
    for seen, (step, skipped) in enumerate(pairs, 1):
        win.push(float(skipped))
        settle = settled if settled is not None else min(
            _policy_at(policy, step).get("monitor.min_steps", min_steps), window)
        young = settle if win.count < settle and win.count < seen else 0  # (RunMonitor._young_after_restart)
        rates.append(round(win.total) / max(win.held, young))
        if step in restarts:
            win = RollingWindow(window)
    return rates


REPLAYED_POLICY = {"max_norm": "max_norm", "monitor.alert_rate": "alert_rate", "monitor.clear_rate": "clear_rate",
                   "monitor.fail_rate": "fail_rate",
                   "monitor.fail_after": "fail_after", "monitor.min_steps": "min_steps",
                   "monitor.fail_on_scale_collapse": "fail_on_scale_collapse",
                   "scaler.growth_interval": "growth_interval"}
"""The settings a resume may change (a policy change) that decide what the monitor counts: the
config key, and the :class:`RunMonitor` attribute it sets."""


def policy_changes_of(run_dir: Path | LoggedEvents) -> list[dict[str, Any]]:
    """The run's policy changes on resume that a replay follows (:data:`REPLAYED_POLICY`), from its
    ``events.jsonl`` in the order they were made: each ``{key, old, new, step}``, applied from
    ``step + 1`` (as :func:`_events_kept` keeps them).

    Example::

        >>> import json, shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> events = [{"step": 0, "event": "run_start"}, {"step": 8, "event": "policy_change", "key": "max_norm",
        ...            "old": 1.0, "new": 2.0}, {"step": 8, "event": "policy_change", "key": "optimizer.lr",
        ...            "old": 0.1, "new": 0.2}]
        >>> _ = (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in events) + '{"step": 9')
        >>> policy_changes_of(folder)
        [{'step': 8, 'event': 'policy_change', 'key': 'max_norm', 'old': 1.0, 'new': 2.0}]
        >>> with (folder / "events.jsonl").open("a") as f:  # then a resume from step 4: the change at 8 is gone
        ...     _ = f.write("\\n" + json.dumps({"step": 4, "event": "resume"}) + "\\n")
        >>> policy_changes_of(folder)
        []
        >>> shutil.rmtree(folder)
    """
    return _events_kept(run_dir, lambda event: (
        event.get("event") == "policy_change" and event.get("key") in REPLAYED_POLICY and "old" in event
        and "new" in event and _policy_value(event["key"], event["old"]) and _policy_value(event["key"], event["new"])))


def rollbacks_of(run_dir: Path | LoggedEvents) -> list[dict[str, Any]]:
    """The run's rollbacks that a replay follows, from its ``events.jsonl`` (as :func:`_events_kept`
    keeps them): each ``{step, updates_undone, ...}``. After its step the run forgot its rolling
    skip window and the updates the checkpoint did not hold (:func:`replay` does the same).

    Example::

        >>> import json, shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> events = [{"step": 7, "event": "rollback", "updates_undone": 3}, {"step": 9, "event": "rollback"}]
        >>> _ = (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in events))
        >>> [(e["step"], e["updates_undone"]) for e in rollbacks_of(folder)]  # (the one saying no count: passed over)
        [(7, 3)]
        >>> with (folder / "events.jsonl").open("a") as f:  # a resume from step 7's checkpoint: saved after it
        ...     _ = f.write(json.dumps({"step": 7, "event": "resume"}) + "\\n")
        >>> [e["step"] for e in rollbacks_of(folder)]
        [7]
        >>> shutil.rmtree(folder)
    """
    return _events_kept(run_dir, lambda event: (event.get("event") == "rollback"
                                                and whole_number(event.get("updates_undone"))), at_resume=True)


HEADROOM_ALERTS_SHOWN = 3
"""How many headroom alerts the run card and ``report`` name (the rest counted)."""


def headroom_alerts_text(run_dir: Path | LoggedEvents | None, alert_bits: float | None = None) -> str:
    """The run's ``headroom_alert`` events (as :func:`_events_kept` keeps them), in a few words: how
    many, and the first few (step, module, tensor, judged bits, shown on their side of the alert's
    threshold: its ``alert_bits``, or ``alert_bits`` given here for an event without one): the
    early warning, for the run card and ``report`` (the console's ALERT lines are gone with the
    scrollback).

    Example::

        >>> import json, shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> headroom_alerts_text(folder)
        'none'
        >>> events = [{"step": 25, "event": "headroom_alert", "module": "4", "tensor": "output", "judged_bits": 15.43},
        ...           {"step": 26, "event": "headroom_clear"}, {"step": 30, "event": "headroom_alert", "module": "2"},
        ...           {"step": 31, "event": "headroom_alert", "module": "1"}, {"step": 30, "event": "resume"}]
        >>> _ = (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in events))
        >>> headroom_alerts_text(folder)  # (step 31's future was trained again; step 30's alert came before its save)
        '2 (step 25: 4 output 15.4 bits; step 30: 2)'
        >>> _ = (folder / "events.jsonl").write_text(json.dumps(
        ...     {"step": 8, "event": "headroom_alert", "module": "2", "tensor": "output", "judged_bits": "-inf"}) + "\\n")
        >>> headroom_alerts_text(folder)  # (an overflow: events.jsonl writes a non-finite number as its text)
        '1 (step 8: 2 output -inf bits)'
        >>> _ = (folder / "events.jsonl").write_text(json.dumps(
        ...     {"step": 8, "event": "headroom_alert", "module": "2", "tensor": "output", "judged_bits": 3.99,
        ...      "alert_bits": 4.0}) + "\\n")
        >>> headroom_alerts_text(folder)  # (on its side of the alert's threshold: not "4.0 bits")
        '1 (step 8: 2 output 3.99 bits)'
        >>> _ = (folder / "events.jsonl").write_text(json.dumps(
        ...     {"step": 8, "event": "headroom_alert", "module": "2", "tensor": "output", "judged_bits": 3.99}) + "\\n")
        >>> headroom_alerts_text(folder, alert_bits=4.0)  # (an older run's event: the config's threshold)
        '1 (step 8: 2 output 3.99 bits)'
        >>> shutil.rmtree(folder)
    """
    # (at_resume: an alert at step s is raised in step s, before its checkpoint: a resume from s keeps it)
    alerts = _events_kept(run_dir, lambda event: event.get("event") == "headroom_alert", at_resume=True) \
        if run_dir else []
    if not alerts:
        return "none"

    def said(alert: dict[str, Any]) -> str:
        bits = alert.get("judged_bits")
        if bits in ("-inf", "inf"):  # (an overflow's, written as its text)
            bits = float(bits)
        where = " ".join(str(alert[k]) for k in ("module", "tensor") if isinstance(alert.get(k), str))
        shown_bits = real_number(bits)
        bound = alert.get("alert_bits", alert_bits)  # (kept on its side of the threshold: 3.99 below 4 read "4.0 bits")
        text = (bits_shown(bits, bound) if real_number(bound) else f"{bits:.1f}") if shown_bits else ""
        return f"step {alert['step']}: {where}" + (f" {text} bits" if shown_bits else "")

    shown_ = "; ".join(said(a) for a in alerts[:HEADROOM_ALERTS_SHOWN])
    return f"{len(alerts)} ({shown_}{'; ...' if len(alerts) > HEADROOM_ALERTS_SHOWN else ''})"


MAX_EVENT_LINE = 16 << 20
"""The longest line of ``events.jsonl`` that :class:`LoggedEvents` reads (16 MiB, bytes; a run's
event is well under a kilobyte, a diagnosis' a few): a longer one is no event of a run's, passed
over as an unreadable line without being held whole (review 55d: a 1 GiB line crashed ``report``
and ``compare`` with a ``MemoryError`` traceback under a memory limit)."""


class LoggedEvents:
    """A run folder's ``events.jsonl``, read once (at the first question) and asked many times:
    ``report`` and ``compare`` derive a replay's inputs from it (policy changes, rollbacks, segment
    ends, scale restarts, the end), each from the same reading, so a live run's log appended
    between them cannot give one replay two different histories. The functions that take a run
    folder take one of these in its place.

    Example::

        >>> import json, shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "events.jsonl").write_text(json.dumps({"step": 3, "event": "rollback", "updates_undone": 1})
        ...                                          + "\\n")
        >>> log = LoggedEvents(folder)
        >>> [e["step"] for e in rollbacks_of(log)]
        [3]
        >>> (folder / "events.jsonl").unlink()  # (read once: the log is as it was at its first question)
        >>> [e["step"] for e in rollbacks_of(log)], rollbacks_of(folder)
        ([3], [])
        >>> shutil.rmtree(folder)
    """

    def __init__(self, run_dir: Path) -> None:
        self.dir = Path(run_dir)
        self._events: list[dict[str, Any]] | None = None
        self._unreadable: list[int] = []

    @staticmethod
    def of(source: Path | LoggedEvents) -> LoggedEvents:
        """``source`` itself, or the log of the run folder it names."""
        return source if isinstance(source, LoggedEvents) else LoggedEvents(source)

    def events(self) -> list[dict[str, Any]]:
        """Every event the file holds, in the order they were made: ``[]`` without the file; a line
        that is no JSON object with a whole-number step (a torn last line) passed over, and counted
        (:meth:`unreadable`) unless it is the last with no newline."""
        if self._events is None:
            self._events = self._read()
        return self._events

    def unreadable(self) -> list[int]:
        """The numbers (from 1) of the lines :meth:`events` passed over that are not a torn last line
        (one with no newline: a write a kill cut short, nothing lost) nor blank: damage inside the file
        (a flipped byte, a bad sector, a hand edit), whose rollback, resume or policy change the replay
        does not know of (review 52c: report's counts then differed from the card's, unsaid)."""
        self.events()
        return self._unreadable

    def _read(self) -> list[dict[str, Any]]:
        import json

        path = self.dir / "events.jsonl"
        if not path.exists():
            return []
        events: list[dict[str, Any]] = []
        number = 0
        try:
            _regular(path)
            with path.open("rb") as file:
                # line by line, each at most MAX_EVENT_LINE bytes read (review 55d: a 1 GiB line, read whole, was a
                # MemoryError traceback under a memory limit); a longer one is passed over to its newline, unreadable
                while raw := file.readline(MAX_EVENT_LINE + 1):
                    if len(raw) > MAX_EVENT_LINE and not raw.endswith(b"\n"):
                        while raw and not raw.endswith(b"\n"):
                            raw = file.readline(MAX_EVENT_LINE)
                        number += 1
                        if raw:  # (one that the file ends in, with no newline, is a torn last line: not said)
                            self._unreadable.append(number)
                        continue
                    text = raw.decode("utf-8", errors="replace")
                    lines = text.splitlines()  # (a lone CR or another line break splits it too, as a whole read did)
                    for at, line in enumerate(lines, start=1):
                        number += 1
                        try:
                            event = json.loads(line)
                        except (ValueError, RecursionError):  # (a line nested past the parser's depth: not the run's)
                            event = None
                        if isinstance(event, dict) and isinstance(event.get("step"), int):
                            events.append(event)
                        elif line.strip() and not (at == len(lines) and not text.endswith(("\n", "\r"))):
                            self._unreadable.append(number)  # (review 52c: damage inside, said; a torn last not)
        except OSError as err:
            raise InputError(f"{path}: cannot read the run's events ({failed_because(err)})") from None
        return events

    def kept(self, wanted: Callable[[dict[str, Any]], bool], *, at_resume: bool = False) -> list[dict[str, Any]]:
        """The events that ``wanted`` takes, in the order they were made. A ``resume`` at step s
        abandons what came after s, so those made before it later than s go (that future was
        trained again without them), and those at s too unless ``at_resume``: a policy change at s
        was made by an earlier resume from s, for steps after it; a rollback at s happened in step
        s, before that step's checkpoint was saved. One ``wanted`` refuses (values that are not of
        their kind: a hand edit) is passed over."""
        kept: list[dict[str, Any]] = []
        for event in self.events():
            if event.get("event") == "resume":
                kept = [e for e in kept if e["step"] < event["step"] or (at_resume and e["step"] == event["step"])]
            elif wanted(event):
                kept.append(event)
        return kept


def _events_kept(source: Path | LoggedEvents, wanted: Callable[[dict[str, Any]], bool], *, at_resume: bool = False
                 ) -> list[dict[str, Any]]:
    """:meth:`LoggedEvents.kept` of ``source`` (a run folder, or its log already read)."""
    return LoggedEvents.of(source).kept(wanted, at_resume=at_resume)


def _policy_value(key: str, value: Any) -> bool:
    """Whether ``value`` is one the setting ``key`` takes: of its kind (what a run writes: a
    number, a whole number for counts, a bool for the switch, ``null`` for a setting off) and in
    its range, by the config's own rule for that field (a hand-edited ``fail_after: 0`` failed the
    replay with a traceback; ``alert_rate: 7`` judged it by nonsense).

    Example::

        >>> [_policy_value("max_norm", v) for v in (2.0, None, "2.0", True, -1.0, math.inf)]  # (-1: clipping off)
        [True, True, False, False, True, False]
        >>> [_policy_value("monitor.fail_after", v) for v in (3, 3.5, 0)]
        [True, False, False]
        >>> [_policy_value("monitor.alert_rate", v) for v in (0.2, 7, None)], _policy_value("monitor.fail_rate", None)
        ([True, False, False], True)
    """
    if key == "monitor.fail_on_scale_collapse":
        kind = isinstance(value, bool)
    elif isinstance(value, bool):
        kind = False
    elif key in ("monitor.fail_after", "monitor.min_steps", "scaler.growth_interval"):
        kind = isinstance(value, int)
    else:  # (None where the field takes it: the range check says)
        kind = value is None or isinstance(value, (int, float))
    return kind and _in_range(key, value)


def _in_range(key: str, value: Any) -> bool:
    """Whether the config field ``key`` (``max_norm``, ``monitor.*``, ``scaler.*``) takes ``value`` on its own
    (its type's bounds; a rule between fields is the replay's)."""
    import pydantic

    try:
        _field_adapter(key).validate_python(value)
    except pydantic.ValidationError:
        return False
    return True


@functools.cache
def _field_adapter(key: str) -> Any:
    """A pydantic ``TypeAdapter`` of the config field ``key``, its bounds included."""
    from typing import Annotated

    import pydantic

    from .config import Config, MonitorConfig, ScalerConfig

    section, _, name = key.rpartition(".")
    model = {"monitor": MonitorConfig, "scaler": ScalerConfig}.get(section, Config)
    field = model.model_fields[name]
    return pydantic.TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)


def _regular(path: Path) -> None:
    """``OSError`` unless ``path`` is a regular file: reading a named pipe (or a device) would wait
    for a writer for ever."""
    if path.is_dir():  # (review 54n: a folder was called "a pipe, a device")
        raise OSError(errno.EISDIR, "is a folder, not a file", str(path))
    if path.exists() and not path.is_file():
        raise OSError(errno.EINVAL, "not a regular file (a pipe, a device)", str(path))


def _policy_at(changes: Sequence[dict[str, Any]], step: int) -> dict[str, Any]:
    """Each changed key's value at ``step``: the last change made before it, else the first one's
    old value (``changes`` as :func:`policy_changes_of` gives them: those of abandoned futures gone).

    Example (max_norm 1 -> 2 from step 5, then 2 -> 3 from step 9)::

        >>> changes = [{"key": "max_norm", "old": 1.0, "new": 2.0, "step": 4},
        ...            {"key": "max_norm", "old": 2.0, "new": 3.0, "step": 8}]
        >>> [_policy_at(changes, step)["max_norm"] for step in (4, 5, 9)]
        [1.0, 2.0, 3.0]
    """
    values: dict[str, Any] = {}
    for change in changes:
        values.setdefault(change["key"], change["old"])
    for change in changes:
        if change["step"] < step:
            values[change["key"]] = change["new"]
    return values


def threshold_by_step(steps: Sequence[int], key: str, value: Any, changes: Sequence[dict[str, Any]]) -> list[Any]:
    """The threshold ``key`` each of ``steps`` ran under: ``value`` (the run's config, its last)
    throughout, unless a resume changed it (``changes`` as :func:`policy_changes_of` gives them);
    ``max_norm`` as the clip reads it (None: clipping off).

    Example (max_norm 1 -> 0.5 on a resume at step 2)::

        >>> threshold_by_step([1, 2, 3, 4], "max_norm", 0.5, [{"key": "max_norm", "old": 1.0, "new": 0.5, "step": 2}])
        [1.0, 1.0, 0.5, 0.5]
    """
    mine = [c for c in changes if c["key"] == key]
    values = [_policy_at(mine, step).get(key, value) for step in steps]
    return [clip_threshold(v) for v in values] if key == "max_norm" else values


def threshold_text(steps: Sequence[int], values: Sequence[Any]) -> str:
    """Per-step thresholds (:func:`threshold_by_step`) in a few words: the one value, or each with
    the step it began at; ``off`` for none.

    Example::

        >>> threshold_text([1, 2, 3], [1.0, 1.0, 1.0]), threshold_text([1, 2, 3, 4], [1.0, 1.0, 0.5, None])
        ('1', '1, 0.5 from step 3, off from step 4')
    """
    parts: list[str] = []
    for i, (step, v) in enumerate(zip(steps, values)):
        if i == 0 or v != values[i - 1]:
            shown_v = "off" if v is None else f"{v:g}"
            parts.append(shown_v if i == 0 else f"{shown_v} from step {step}")
    return ", ".join(parts) or "off"


def threshold_line(ax: Any, steps: Sequence[int], values: Sequence[Any], label: str, **style: Any) -> None:
    """A threshold's line on ``ax``: flat while it held (a horizontal line across the panel when
    it never changed), a step where a resume changed it, nothing where it was off; ``label`` and
    :func:`threshold_text` name it."""
    if not any(v is not None for v in values):
        return
    if len(set(values)) == 1:
        ax.axhline(values[0], label=f"{label} = {values[0]:g}", **style)
        return
    ax.plot(steps, [math.nan if v is None else v for v in values], drawstyle="steps-post",
            label=f"{label} = {threshold_text(steps, values)}", **style)


CARD_ENDED_ROW = "ended"
"""The row of a Hugging Face Trainer's run card (``integrations.transformers.run_card``) that says
how its run ended, ``finished: 10 steps (exit 0)``: that card has no bold line (``report`` called
it "no run card ampguard wrote ... ended: unknown")."""


def read_card(card: Path, *, errors: str = "strict") -> tuple[str, dict[str, str]]:
    """A run card in one read: why the run ended (its bold line, ``**finished: 20 steps**``;
    ``"unknown"`` without one) and its table rows (``| key | value |``, set-up and outcome) by
    key, each cell's escaped ``\\|`` (:func:`~ampguard.errors.table_cell`) read back as ``|``. A
    card that cannot be read raises (``OSError``; ``UnicodeDecodeError`` with ``errors="strict"``).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     card = Path(d) / "RUN.md"
        ...     _ = card.write_text("# Run a\\n\\n**finished: 20 steps**\\n\\n| | |\\n|---|---|\\n| processes | 1 |\\n")
        ...     read_card(card)
        ('finished: 20 steps', {'processes': '1'})
        >>> with tempfile.TemporaryDirectory() as d:
        ...     card = Path(d) / "RUN.md"
        ...     _ = card.write_text("| | |\\n|---|---|\\n| held-out acc\\\\|top1 | final 0.5 |\\n| ended | a \\\\| b |\\n")
        ...     read_card(card)[1]
        {'held-out acc|top1': 'final 0.5', 'ended': 'a | b'}
    """
    _regular(card)
    lines = [line.strip() for line in card.read_text(encoding="utf-8", errors=errors).splitlines()]
    bold = [line[2:-2] for line in lines if line.startswith("**") and line.endswith("**")]
    rows: dict[str, str] = {}
    for line in lines:
        # the cells' border, " | ": a `|` in a cell is written `\|` (table_cell), never after a space (a run
        # card's module, metric or error message holding " | " lost its row here, and its value in a Markdown
        # view, review 56d)
        cells = [c.strip() for c in line.strip("|").split(" | ")] if line.startswith("| ") else []
        if len(cells) == 2 and cells[0] and not set(cells[0]) <= set("-"):
            rows.setdefault(cells[0].replace("\\|", "|"), cells[1].replace("\\|", "|"))
    return (bold[0] if bold else "unknown"), rows


def trainer_card_ended(card: Path, *, errors: str = "strict") -> str:
    """Why the run ended, as the card's bold line says (:func:`read_card`'s first half), or, on a
    card without the bold line, as its ``ended`` row says (a Hugging Face Trainer's card: ``finished: 10 steps (exit 0)``).

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     card = Path(d) / "RUN.md"
        ...     _ = card.write_text("# ampguard run card (Hugging Face Trainer)\\n\\n| | |\\n|---|---|\\n"
        ...                         "| ended | finished: 10 steps (exit 0) |\\n")
        ...     read_card(card)[0], trainer_card_ended(card)
        ('unknown', 'finished: 10 steps (exit 0)')
    """
    ended, table = read_card(card, errors=errors)
    return table.get(CARD_ENDED_ROW, ended) if ended == "unknown" else ended


def finished(card: Path, events: LoggedEvents | None = None) -> bool:
    """Whether a run card says its run trained to the end (``**finished: N steps**``), or, where
    the card cannot say (none, a folder, not text), the last ``run_end`` event beside it does:
    only then does a replay judge the run whole, as the run did (a stop, even at the last step,
    did not).

    Example::

        >>> import json, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     card = Path(d) / "RUN.md"
        ...     missing = finished(card)
        ...     _ = card.write_text("# Run a\\n\\n**finished: 20 steps**\\n")
        ...     done = finished(card)
        ...     _ = card.write_text("# Run a\\n\\n**strict mode: non-finite loss at step 5**\\n")
        ...     stopped = finished(card)
        ...     card.unlink()  # (its card lost: the event log says how it ended)
        ...     _ = (Path(d) / "events.jsonl").write_text(json.dumps(
        ...         {"step": 20, "event": "run_end", "message": "finished: 20 steps"}) + "\\n")
        ...     missing, done, stopped, finished(card)
        (False, True, False, True)
    """
    end = _last_end(card, events)
    return end is not None and judged_at_end(end[0])


def _last_end(card: Path, events: LoggedEvents | None = None) -> tuple[str, int | None, str] | None:
    """How a run said it ended: its card's words (a Trainer's card in its ``ended`` row), or,
    where the card cannot say (none, a folder, not text), its last ``run_end`` event's; with the
    step it ended at (the card's from its words, :data:`_ENDED_STEP`, None where they name none)
    and what said it. None where neither says. (:func:`finished` and :func:`ended_at` read it.)"""
    try:  # (a Trainer's card says it in its `ended` row: it read as no card, and the event log decided)
        ended = trainer_card_ended(card, errors="replace")
    except OSError:
        ended = "unknown"
    if ended != "unknown":
        found = _ENDED_STEP.match(ended)
        return ended, int(found[1] or found[2]) if found else None, "its card"
    ends = _events_kept(events or card.parent, lambda event: event.get("event") == "run_end")
    return (str(ends[-1].get("message", "")), ends[-1]["step"], "its run_end event") if ends else None


def judged_at_end(ended: str) -> bool:
    """Whether a run that ended so (its card's or its ``run_end``'s words) had its steps judged
    whole at its last (:meth:`~ampguard.monitor.RunMonitor.at_end`): it trained to the end, or a
    guard stopped it there for what that judgement found (review 50k: such a run's ALERT was on
    its card and lost in report's count).

    Example::

        >>> judged_at_end("finished: 20 steps"), judged_at_end("stopped by the guard at the end of the run (step 20): ...")
        (True, True)
        >>> judged_at_end("interrupted (SIGINT) after step 7")
        False
    """
    return ended.startswith(("finished: ", f"stopped by the guard {AT_THE_END}", f"stopped by a guard {AT_THE_END}"))


_ENDED_STEP = re.compile(rf"finished: (\d+) steps?\b|stopped by (?:the|a) guard {re.escape(AT_THE_END)}(\d+)\)")
"""The step in the words of a run's end judged whole there (:func:`judged_at_end`)."""


def ended_at(card: Path, events: LoggedEvents | None = None) -> tuple[int, str] | None:
    """The step a run judged whole at its end (:func:`finished`) ended at, and what says so: its
    card's words (``finished: 30 steps``), or, where the card cannot say, its last ``run_end``
    event; None for a run that did not end so, or whose end names no step. Rows that stop before
    it are not the run's end (review 52c: a steps.csv cut short was judged whole at its last row,
    unsaid).

    Example::

        >>> import json, tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     card = Path(d) / "RUN.md"
        ...     _ = card.write_text("# Run a\\n\\n**finished: 20 steps**\\n")
        ...     done = ended_at(card)
        ...     _ = card.write_text("# Run a\\n\\n**interrupted (SIGINT) after step 7**\\n")
        ...     stopped = ended_at(card)
        ...     card.unlink()
        ...     _ = (Path(d) / "events.jsonl").write_text(json.dumps(
        ...         {"step": 20, "event": "run_end", "message": "stopped by the guard at the end of the run (step 20): x"})
        ...         + "\\n")
        ...     done, stopped, ended_at(card)
        ((20, 'its card'), None, (20, 'its run_end event'))
    """
    end = _last_end(card, events)
    if end is None or not judged_at_end(end[0]) or end[1] is None:
        return None
    return end[1], end[2]


def cut_short(rows: Sequence[Row], torn: Sequence[str], ended: tuple[int, str] | None) -> bool:
    """Whether a CSV's ``rows`` stop before the step its run ``ended`` at, judged whole there
    (:func:`ended_at`): rows missing at its end (a partial copy, ``head``), so the replay does not
    judge them as the run's end. Not so when the one row missing is the last, ``torn`` (its write
    cut short: review 33e, the run's end still judged on the rows before it, as its card was).

    Example::

        >>> rows = [Row(s, 0.1, 2.0, 1.0, 0.5, False, "", 1.0) for s in (1, 2)]
        >>> cut_short(rows, [], (30, "its card")), cut_short(rows, ["3,0.1"], (3, "its card")), cut_short(rows, [], None)
        (True, False, False)
    """
    return bool(rows) and ended is not None and rows[-1].step + (1 if torn else 0) < ended[0]


def segment_ends(run_dir: Path | LoggedEvents) -> list[int]:
    """The steps where a resumed run's earlier part ended judged whole (:func:`judged_at_end`,
    its ``run_end`` at the step a resume went on from): the run's monitor judged it there, and
    the resumed part carried that judgement on (review 50k: its end-of-run ALERT was on the card,
    lost in report's replay). The run's own last end is :func:`finished`'s."""
    ends = _events_kept(run_dir, lambda event: event.get("event") == "run_end" and
                        judged_at_end(str(event.get("message", ""))), at_resume=True)
    return sorted({event["step"] for event in ends})


def replay(rows: list[Row], monitor: RunMonitor | None = None, *, policy: Sequence[dict[str, Any]] = (),
           rollbacks: Sequence[dict[str, Any]] = (), finished: bool = False, ends: Sequence[int] = (),
           metrics: Sequence[dict[str, float]] | None = None, scales: dict[int, float] | None = None,
           **monitor_args: Any) -> RunMonitor:
    """Feed CSV rows through a :class:`RunMonitor` (``monitor``, or one made of ``monitor_args``):
    the same statistics the live run kept. ``metrics``: each row's held-out metrics (empty where
    none), observed with it. ``policy`` (:func:`policy_changes_of`) sets the thresholds each step
    ran under, where a resume changed them; after the step of each of ``rollbacks``
    (:func:`rollbacks_of`) the monitor forgets its window and the updates undone, and its final
    loss and last held-out metrics go back to the checkpoint's step, as the run's did (its rows
    go on: the step counter does; a spike at the last step is not the run's final loss).
    ``finished`` (a run that trained to the end: :func:`finished`): its rows are judged whole at
    the last, as the run was (:meth:`~ampguard.monitor.RunMonitor.at_end`); rows a torn last line
    or a hand left out are not in that judgement (the reading notes say they are missing; before,
    such a run lost its end's ALERT in report and compare, while its card counted it); rows that
    stop before the run's end (:func:`cut_short`) are not judged so at all: ``report`` and
    ``compare`` pass ``finished`` False for them. ``ends``
    (:func:`segment_ends`): the steps where an earlier part of a resumed run was so judged.
    ``scales`` (:func:`scale_restarts`): the loss scale a step ran with where the step before did
    not leave it (step 1's, a rollback's, a resume's new ``init_scale``), as the run's trainer told
    its monitor (:meth:`~ampguard.monitor.RunMonitor.scale_restarted`).

    Example (``monitor_args`` are :class:`RunMonitor`'s; max_norm 1, then 4 from step 3)::

        >>> rows = [Row(step, 0.1, 2.0, 1.0, 0.5, False, "", 1.0) for step in (1, 2, 3)]
        >>> rows.append(Row(4, 0.1, None, None, float("nan"), True, "non_finite_loss", 1.0))
        >>> monitor = replay(rows, window=10, scaler_enabled=False)
        >>> monitor.steps, monitor.updates, monitor.clipped, dict(monitor.skips), round(monitor.skip_rate, 3)
        (4, 3, 3, {'non_finite_loss': 1}, 0.25)
        >>> replay(rows, window=10, scaler_enabled=False, max_norm=4.0,
        ...        policy=[{"key": "max_norm", "old": 1.0, "new": 4.0, "step": 2}]).clipped
        2
    """
    monitor = RunMonitor(**monitor_args) if monitor is None else monitor
    targets = {_checkpoint_step(r) for r in rollbacks} - {None}
    kept = {0: monitor.state_dict()}  # what the rollbacks' checkpoints held (the run's start: step-00000000.pt)
    for i, row in enumerate(rows):
        for key, value in _policy_at(policy, row.step).items():
            setattr(monitor, REPLAYED_POLICY[key], clip_threshold(value) if key == "max_norm" else value)
        if scales and row.step in scales:
            monitor.scale_restarted(scales[row.step])
        monitor.observe(row.record())
        if metrics is not None and metrics[i]:  # (evaluated on this step's model, before any rollback)
            monitor.observe_eval(metrics[i])
        for rollback in (r for r in rollbacks if r["step"] == row.step):  # (as guards.Rollbacks.apply did)
            monitor.rolled_back(max(0, monitor.updates - rollback["updates_undone"]), kept.get(_checkpoint_step(rollback)),
                                skip_guard=rollback.get("kind") == "skip_guard")  # (guards.SKIP_GUARD)
        if row.step in ends and row is not rows[-1]:  # (an earlier part's end: the run judged it there)
            monitor.at_end(row.step)
        if row.step in targets:  # (a checkpoint is saved after its step's records and rollbacks)
            kept[row.step] = monitor.state_dict()
    if rows and finished:
        monitor.at_end(rows[-1].step)
    return monitor


def _checkpoint_step(rollback: dict[str, Any]) -> int | None:
    """The step of the checkpoint a rollback event went back to (None when it names none)."""
    from .checkpoint import checkpoint_step

    name = rollback.get("checkpoint")
    step = checkpoint_step(Path(name)) if isinstance(name, str) else -1
    return step if step >= 0 else None


# ---------------------------------------------------------------------------- the plot


def shown(text: str) -> str:
    """``text`` as it can be drawn and printed: the bytes of a file name that are not UTF-8 (which
    Python keeps as surrogate escapes, and matplotlib cannot draw) read as U+FFFD, and each
    control character written as its escape (:func:`~ampguard.errors.visible`; review 55d: a run
    folder named with an escape sequence put it raw in the plot's title, which matplotlib warned
    of, quoting it, on the terminal).

    Example::

        >>> shown("run a\\udcffb"), shown("run ä"), shown("run \\x1b[31mred")
        ('run a\ufffdb', 'run ä', 'run \\\\x1b[31mred')
    """
    return visible(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))


def import_matplotlib() -> None:
    """What the plots draw with (:class:`matplotlib.figure.Figure`, the Agg canvas) imported with
    the stop signals held, by a verb that draws outside a run (``report``, ``compare``): a Ctrl-C
    or SIGTERM in the import reached matplotlib wrapped in a ``RuntimeError`` that its ``except
    Exception`` around its 3-D import swallowed, and the verb drew and exited 0 (review 52m); held,
    it stops the verb as the import ends. A run's own handlers only take note: ``plot_run`` imports
    it there itself. Never pyplot, nor ``matplotlib.use``: a plot is a :func:`new_figure`, and a
    run, ``report`` or ``compare`` called in a notebook's process leaves its backend and pyplot's
    figures as they were (review 55r: they switched it to Agg for the kernel's life, and inline
    plots and ``plt.show()`` stopped showing)."""
    from .signals import held_signals

    with held_signals():
        for module in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
            importlib.import_module(module)


def new_figure(rows: int, figsize: tuple[float, float], dpi: float = DPI, **kwargs: Any) -> tuple[Any, Any]:
    """A figure of ``rows`` panels on a shared x axis at ``dpi``, drawn on its own Agg canvas,
    and its axes: what ``plt.subplots(rows, 1, sharex=True, ...)`` makes, without pyplot (no
    backend chosen, nothing in pyplot's figure list, nothing to close; the PNG is the same,
    byte for byte).

    Example::

        >>> import matplotlib, matplotlib.pyplot as plt
        >>> backend, figures = matplotlib.get_backend(), plt.get_fignums()
        >>> fig, axes = new_figure(2, (4.0, 3.0))
        >>> len(axes), type(fig.canvas).__name__, (matplotlib.get_backend(), plt.get_fignums()) == (backend, figures)
        (2, 'FigureCanvasAgg', True)
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout=kwargs.pop("layout", None))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, sharex=True, **kwargs)


def plot_run(
    csv_path: str | Path,
    png_path: str | Path,
    *,
    max_norm: float | None = 1.0,
    window: int = 1000,
    alert_rate: float = 0.05,
    fail_rate: float | None = None,
    min_steps: int = DEFAULT_MIN_STEPS,
    title: str | None = None,
    headroom: str | Path | None = None,
    alert_bits: float | None = None,
    init_scale: float = 1.0,
    note: Callable[[str], None] | None = None,
    policy: Sequence[dict[str, Any]] = (),
    events_dir: Path | LoggedEvents | None = None,
    scaler_on: bool = True,
    scale_floor: float = 1.0,
    unobserved: int = 0,
) -> Path:
    """Draw one PNG (1200 x 1400 px) with five panels on a shared step axis: loss, pre/post-clip
    norm with the ``max_norm`` line, log2 of the loss scale, learning rate, and the rolling skip
    rate with its thresholds (each line the value each step ran under: ``policy``, the run's
    changes on resume as :func:`policy_changes_of` gives them, make a step where one changed;
    the rate's window emptied at each rollback ``events_dir``'s ``events.jsonl`` names, as the
    run's). Skipped steps are marked on every panel, coloured by reason.
    With ``headroom`` (a ``headroom.csv`` with rows), a sixth panel below (the PNG 500 px
    taller): the layer x step heatmap of :func:`headroom_panel`, each gradient judged at the loss
    scale its step ran with (the row before's ``scaler_scale``; ``init_scale`` at the run's first
    step; after a rollback or a resume that set the scale anew, the one it set, read from the
    ``events.jsonl`` in ``events_dir``, for a run with a loss scaler, ``scaler_on``: :func:`scale_restarts`); a ``headroom`` that does not read leaves the heatmap out, said through ``note`` (without
    one, its error is raised). The PNG carries ampguard's mark
    (:func:`plot_metadata`), so that ``report`` may draw it again (:func:`check_plot_path`).

    Example (the PNG's width and height are in its header)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> from ampguard.sinks import CSV_COLUMNS
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n"
        ...                         "2,0.1,inf,,0.4,1,non_finite_grad,32768.0\\n3,0.1,0.5,0.5,0.3,0,,32768.0\\n")
        >>> png = plot_run(csv_path, folder / "report.png", window=10)
        >>> import struct
        >>> png.name, struct.unpack(">II", png.read_bytes()[16:24]), drawn_by_ampguard(png)
        ('report.png', (1200, 1400), True)
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n")
        >>> try:
        ...     plot_run(csv_path, folder / "empty.png")
        ... except InputError as err:
        ...     print(str(err).replace(str(folder), "DIR"), (folder / "empty.png").exists())
        DIR/steps.csv: no steps recorded yet, nothing to plot False
        >>> shutil.rmtree(folder)
    """
    rows = read_step_columns(csv_path)  # (a stream into compact arrays: review 55b)
    if not len(rows):
        raise InputError(f"{csv_path}: no steps recorded yet, nothing to plot")
    try:
        heat = read_headroom_csv(headroom) if headroom is not None else []
    except InputError as err:  # (the per-step panels need only steps.csv)
        if note is None:
            raise
        note(f"{err}: the plot leaves the headroom heatmap out")
        heat = []

    size = (FIGSIZE[0], FIGSIZE[1] + (HEATMAP_HEIGHT if heat else 0.0))
    # the heatmap's row labels (layer names) are as long as a model makes them: constrained layout
    # measures them; the five panels alone fit fixed margins (tick labels out to -1e308 included),
    # and laying them out by measure was ~45% of the plot's time (0.89 -> 0.61 s a plot)
    fig, axes = new_figure(6 if heat else 5, size, layout="constrained" if heat else None,
                           height_ratios=[1.0] * 5 + ([2.2] if heat else []))
    if not heat:
        fig.subplots_adjust(**PANEL_MARGINS)
    png_path = Path(png_path)
    # drawn beside the target, then renamed over it: a failed write leaves no half a PNG, and an
    # earlier plot stays as it was
    try:
        with temporary_beside(png_path) as partial, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (numpy's overflow notes near the float64 limit)
            shown_title = shown(title or Path(csv_path).name)
            _draw(fig, axes, rows, heat, max_norm=max_norm, window=window, alert_rate=alert_rate,
                  fail_rate=fail_rate, min_steps=min_steps, alert_bits=alert_bits, title=shown_title,
                  init_scale=init_scale,
                  scale_floor=scale_floor, policy=policy, rollbacks=rollbacks_of(events_dir) if events_dir else (),
                  restarts=scale_restarts(events_dir, rows, init_scale) if heat and events_dir and scaler_on else None,
                  unobserved=unobserved)
            # marked as ampguard's (PLOT_MARK): only a plot with the mark is ever drawn again
            fig.savefig(partial, dpi=DPI, format="png", metadata=plot_metadata(f"ampguard report: {shown_title}"))
            os.replace(partial, png_path)
    except OSError as err:
        raise InputError(f"{png_path}: cannot write the plot ({failed_because(err)})") from None
    except (ValueError, ArithmeticError) as err:  # numbers matplotlib cannot lay out: one line, no PNG
        raise InputError(f"{csv_path}: cannot be plotted ({first_line(err, with_type=True)})") from None
    # a partial plot a report killed in its draw left (SIGKILL, the OOM killer) goes; a live one's stays
    # (review 52c: nothing ever took it out of the run folder)
    with contextlib.suppress(OSError):  # (only space: never the plot's failure)
        remove_temporaries(png_path.parent, only=lambda name: name.startswith(f".{png_path.name}.tmp-")
                           and left_by_an_ended_process(name))
    return png_path


LINEAR_LIMIT = 1e300
"""Beyond this magnitude a linear axis overflows (its span, its margins, its ticks): a panel with
such a value is drawn on a symmetric log axis instead."""


def _linear_y(ax: Any, values: list[float], label: str) -> None:
    """A y axis for ``values`` that is linear when it can be, else (a value beyond
    :data:`LINEAR_LIMIT`: losses from -1e308 to 1e308) symmetric log from the lowest value (or 0)
    to the highest (or 0), set outright (autoscaling's margins overflow there); ``label`` says which.

    Example::

        >>> fig, (a, b) = new_figure(2, FIGSIZE)
        >>> _linear_y(a, [0.5, -2.0], "loss"), _linear_y(b, [1e308, -1e308, 0.5], "loss")
        (None, None)
        >>> a.get_yscale(), a.get_ylabel(), b.get_yscale(), b.get_ylabel(), tuple(map(float, b.get_ylim()))
        ('linear', 'loss', 'symlog', 'loss (symlog)', (-1e+308, 1e+308))
    """
    if not any(abs(v) > LINEAR_LIMIT for v in values):
        ax.set_ylabel(label)
        return
    log_y(ax, f"{label} (symlog)", "symlog")
    ax.set_ylim(min(min(values), 0.0), max(max(values), 0.0))


THIN_BUCKETS = 2000
"""A line of more points than twice this (the PNG is 1200 px wide) is drawn thinned
(:func:`thinned`): the lowest and the highest point of each of about this many runs of
consecutive points, so a lone spike, a dip or a skip's mark stays seen; a shorter one, every point."""


def thinned(xs: Any, ys: Any, buckets: int = THIN_BUCKETS) -> tuple[Any, Any]:
    """The points of a line a plot draws (``xs`` rising, numpy arrays): all of them when there are
    at most ``2 * buckets``; else the first, the last, and the lowest and highest of each run of
    ``ceil(len / buckets)`` consecutive points, in step order (review 55b: a million steps drew a
    million points a line, and one spike among them must stay).

    Example (one spike among 10,000 points: kept)::

        >>> import numpy as np
        >>> xs = np.arange(1, 10_001); ys = np.ones(10_000); ys[4321] = 50.0
        >>> tx, ty = thinned(xs, ys, buckets=100)
        >>> len(tx) <= 202, float(ty.max()), int(tx[ty.argmax()]), int(tx[0]), int(tx[-1])
        (True, 50.0, 4322, 1, 10000)
        >>> thinned(xs[:5], ys[:5])[0].tolist()  # (a short line: every point)
        [1, 2, 3, 4, 5]
    """
    import numpy as np

    n = len(xs)
    if n <= 2 * buckets:
        return xs, ys
    size = -(-n // buckets)
    runs = -(-n // size)  # (each run holds a point: the last one's padding is less than a run)
    values = np.asarray(ys, dtype=np.float64)
    padded = np.full(runs * size, np.nan)
    padded[:n] = values
    grid = padded.reshape(runs, size)
    base = np.arange(runs) * size
    lows = base + np.where(np.isnan(grid), np.inf, grid).argmin(axis=1)
    highs = base + np.where(np.isnan(grid), -np.inf, grid).argmax(axis=1)
    kept = np.unique(np.concatenate([[0, n - 1], lows, highs]))
    return np.asarray(xs)[kept], values[kept]


def _thinned_marks(marks: Any, first: int, last: int, buckets: int = THIN_BUCKETS) -> Any:
    """A skip's marks (steps, rising) to draw: each of them when there are at most ``2 * buckets``;
    else the first of each of ``2 * buckets`` equal spans of the steps ``first..last`` that holds
    one (each span under a pixel wide: every skip still marked where it was).

    Example::

        >>> import numpy as np
        >>> _thinned_marks(np.arange(1, 1001), 1, 1000, buckets=10).tolist()[:3], len(_thinned_marks(np.array([7]), 1, 9))
        ([1, 51, 101], 1)
    """
    import numpy as np

    if len(marks) <= 2 * buckets:
        return marks
    spans = (marks - first) * (2 * buckets) // max(1, last - first + 1)
    return marks[np.unique(spans, return_index=True)[1]]


def _changes_at(steps: Any, policy: Sequence[dict[str, Any]]) -> list[int]:
    """The steps a threshold line needs to be drawn from for a run of more than ``2 *``
    :data:`THIN_BUCKETS` steps: the first, the last, and the first after each change of ``policy``
    (:func:`threshold_by_step` holds its value between them); every step for a shorter run."""
    import numpy as np

    if len(steps) <= 2 * THIN_BUCKETS:
        return steps.tolist()
    after = np.searchsorted(steps, [c["step"] for c in policy], side="right")
    return sorted({int(steps[0]), int(steps[-1]), *(int(steps[i]) for i in after if i < len(steps))})


def _draw(fig: Any, axes: Any, rows: Sequence[Row] | StepColumns, heat: list[HeadroomRow], *,
          max_norm: float | None, window: int,
          alert_rate: float, fail_rate: float | None, alert_bits: float | None, title: str,
          min_steps: int = DEFAULT_MIN_STEPS, init_scale: float = 1.0, policy: Sequence[dict[str, Any]] = (), rollbacks: Sequence[dict[str, Any]] = (),
          restarts: Mapping[int, float] | None = None, scale_floor: float = 1.0, unobserved: int = 0) -> None:
    """:func:`plot_run`'s panels on ``axes`` (five, and the headroom heatmap with ``heat``). The rolling
    skip rate begins after the ``unobserved`` steps (:func:`unobserved_of`), as the run's monitor did.
    A line of many steps is drawn :func:`thinned` (its lows and highs kept), a skip's marks
    :func:`_thinned_marks`; a run of up to ``2 *`` :data:`THIN_BUCKETS` steps, every point."""
    import numpy as np

    columns = rows if isinstance(rows, StepColumns) else StepColumns.of(rows)
    ax_loss, ax_norm, ax_scale, ax_lr, ax_skip = axes[:5]
    steps = columns.steps

    def finite(values: Any, positive: bool = False) -> tuple[Any, Any]:
        keep = np.isfinite(values) & (values > 0) if positive else np.isfinite(values)
        return thinned(steps[keep], values[keep])

    xs, ys, marks = gapped_line(steps, columns.loss)
    shown = ys[np.isfinite(ys)]
    log_loss = bool(len(shown)) and shown.min() > 0
    ax_loss.plot(xs, ys, lw=1, color="tab:blue", label="loss (mean of the step's micro-batches)", **marks)
    if log_loss:
        log_y(ax_loss, "loss (log)")
    else:
        _linear_y(ax_loss, shown.tolist(), "loss")
    panel_title(ax_loss, "Loss")

    for values, label, colour in (
        (columns.grad_l2_pre_clip, "pre-clip", "tab:purple"),
        (columns.grad_l2_post_clip, "post-clip", "tab:green"),
    ):
        xs, ys, marks = gapped_line(steps, values, positive=True)
        ax_norm.plot(xs, ys, lw=1, color=colour, label=f"{label} global L2 norm", **marks)
    changes = _changes_at(steps, policy)
    threshold_line(ax_norm, changes, threshold_by_step(changes, "max_norm", max_norm, policy), "max_norm",
                   color="black", ls="--", lw=1)
    log_y(ax_norm, "gradient norm (log)")
    panel_title(ax_norm, "Global gradient L2 norm, before and after clipping")

    xs, ys = finite(columns.scaler_scale, positive=True)
    ax_scale.step(xs, np.log2(ys), where="post", color="tab:brown", lw=1.2, label="log2(scale)", **dots(xs))
    ax_scale.set_ylabel("log2(loss scale)")
    panel_title(ax_scale, "Loss scale (after each step's update; 1.0 = no scaler)")

    xs, ys = finite(columns.lr)
    ax_lr.plot(xs, ys, color="tab:cyan", lw=1.2, label="learning rate (param group 0)", **dots(xs))
    _linear_y(ax_lr, ys.tolist(), "learning rate")
    panel_title(ax_lr, "Learning rate")

    observed = columns.after(unobserved)
    rates = np.array(rolling_skip_rate(observed, window, rollbacks, min_steps, policy), dtype=np.float64)
    label = f"rolling skip rate (window {window})"
    if len(steps) <= 2 * THIN_BUCKETS:  # (the steps before the observed ones: no rate, a gap)
        ax_skip.plot(steps, np.concatenate([np.full(len(steps) - len(observed), np.nan), rates]), color="tab:red",
                     lw=1.2, label=label, **dots(observed.steps))  # (one observed step after the unobserved: a dot)
    else:
        ax_skip.plot(*thinned(observed.steps, rates), color="tab:red", lw=1.2, label=label)
    alert_rates = threshold_by_step(changes, "monitor.alert_rate", alert_rate, policy)
    fail_rates = threshold_by_step(changes, "monitor.fail_rate", fail_rate, policy)
    threshold_line(ax_skip, changes, alert_rates, "alert_rate", color="tab:orange", ls="--", lw=1)
    threshold_line(ax_skip, changes, fail_rates, "fail_rate", color="tab:red", ls=":", lw=1)
    ax_skip.set_ylim(0, max(0.1, *(v * 1.5 for v in alert_rates + fail_rates if v is not None),
                            *((float(rates.max()) * 1.2,) if len(rates) else ())))
    ax_skip.set_ylabel("skip rate")
    panel_title(ax_skip, "Rolling skip rate")
    axes[-1].set_xlabel("step")
    whole_steps(axes[-1])
    first, last = int(steps[0]), int(steps[-1])
    if heat:
        headroom_panel(fig, axes[5], heat, alert_bits, scale_at=_scale_used(columns, init_scale, restarts),
                       run_steps=(first, last), scale_floor=scale_floor)

    for reason in SKIP_REASONS:
        marks = columns.reason_steps(reason)
        if not len(marks):
            continue
        drawn = _thinned_marks(marks, first, last)
        for i, ax in enumerate(axes):
            ax.vlines(drawn, 0, 1, transform=ax.get_xaxis_transform(), color=REASON_COLOURS[reason], alpha=0.35,
                      lw=1, label=f"skipped: {reason} ({len(marks)})" if i == 0 else None)
    for ax in axes[:5]:
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, framealpha=0.8)
    skipped = int(columns.skipped.sum())
    fig.suptitle(f"{title}: {counted(len(columns), 'step')}, {skipped} skipped", fontsize=13)


def headroom_panel(fig: Any, ax: Any, rows: list[HeadroomRow], alert_bits: float | None = None,
                   scale_at: Callable[[int], float | None] | None = None,
                   run_steps: tuple[int, int] | None = None, scale_floor: float = 1.0) -> Any:
    """The headroom heatmap on ``ax`` (its mesh returned): one row per module and tensor (output,
    then the gradient into it; in the model's order, top down), one column per measured step,
    the colour the bits of headroom left below the format's max: red is close to overflowing,
    green is far from it, dark red below 0 (beyond the format: it overflowed, or would when
    cast), grey nothing to tell (a nan). Gradients are drawn as the alert judges them
    (:func:`~ampguard.headroom.judged_bits`): without the loss scale their step ran with
    (``scale_at(step)``), so a healthy fp16 run's growing scale does not paint them red; one
    that overflowed only at a large scale (the scaler's search) is grey. The colour bar marks
    ``alert_bits``. A column spans the steps around its own, up to the next's; the first and the
    last stop at the run's first and last steps (``run_steps``), so the panel's step axis, shared
    with the panels above, ends where the run did.

    Example (a gradient that overflowed at loss scale 8, below 2**alert_bits: dark red)::

        >>> fig, ax = new_figure(1, FIGSIZE)  # (one panel: its axes alone)
        >>> rows = [HeadroomRow(s, "fc", t, 1.0, b, 0.0) for s, t, b in [(10, "output", 9.0), (10, "grad", 3.0),
        ...                                                              (20, "output", 8.0), (20, "grad", -math.inf)]]
        >>> mesh = headroom_panel(fig, ax, rows, alert_bits=4.0, scale_at=lambda step: 8.0)
        >>> ax.get_title(), [t.get_text() for t in ax.get_yticklabels()]
        ("Headroom: bits below the format's max, per layer (every 10 steps; red: close to overflow, dark red: beyond it)", ['fc output', 'fc grad'])
        >>> from matplotlib.colors import to_rgba
        >>> tuple(mesh.to_rgba(mesh.get_array())[1, 1]) == to_rgba("darkred")  # (fc grad, step 20)
        True
    """
    import numpy as np
    from matplotlib import colormaps

    from .headroom import judged_bits

    labels: list[tuple[str, str]] = []
    for r in rows:
        if (r.module, r.tensor) not in labels:
            labels.append((r.module, r.tensor))
    steps = sorted({r.step for r in rows})
    where_label = {label: i for i, label in enumerate(labels)}
    where_step = {step: j for j, step in enumerate(steps)}
    grid = np.full((len(labels), len(steps)), np.nan)
    for r in rows:
        bits = judged_bits(r, scale_at(r.step) if scale_at is not None else None, alert_bits or 0.0, scale_floor)
        grid[where_label[(r.module, r.tensor)], where_step[r.step]] = math.nan if bits is None else bits
    finite = grid[np.isfinite(grid)]
    top = max(1.0, float(finite.max()) if finite.size else 1.0, 2 * (alert_bits or 0.0))
    shown = np.where(np.isposinf(grid), top, grid)  # all zeros: as far from overflow as anything
    shown = np.where(np.isneginf(shown), -1.0, shown)  # overflowed: below the scale, the "under" colour
    cmap = colormaps["RdYlGn"].with_extremes(under="darkred", bad="lightgrey")
    gaps = list(dict.fromkeys(b - a for a, b in zip(steps, steps[1:])))
    gap = gaps[0] if len(gaps) == 1 else (steps[-1] - steps[0]) / max(1, len(steps) - 1) if gaps else 1.0
    edges = [steps[0] - gap / 2] + [(a + b) / 2 for a, b in zip(steps, steps[1:])] + [steps[-1] + gap / 2]
    if run_steps is not None:  # (half a step either side of the run's own: the line panels' last dot)
        edges[0] = max(edges[0], min(run_steps[0], steps[0]) - 0.5)
        edges[-1] = min(edges[-1], max(run_steps[1], steps[-1]) + 0.5)
    mesh = ax.pcolormesh(edges, np.arange(len(labels) + 1), np.ma.masked_where(np.isnan(shown), shown), cmap=cmap,
                         vmin=0.0, vmax=top, shading="flat")
    ax.set_yticks(np.arange(len(labels)) + 0.5, [f"{m} {t}" for m, t in labels], fontsize=7 if len(labels) > 24 else 8)
    ax.set_ylim(len(labels), 0)
    ax.set_ylabel("module, tensor")
    every = ("one measured step" if not gaps else f"every {counted(gaps[0], 'step')}" if len(gaps) == 1 else
             "every " + ", then ".join(map(str, gaps[:3])) + (", ..." if len(gaps) > 3 else "") + " steps")
    ax.set_title(f"Headroom: bits below the format's max, per layer ({every}; red: close to overflow, "
                 "dark red: beyond it)")
    # below the panel, so the heatmap keeps the width (and the step axis) of the panels above
    bar = fig.colorbar(mesh, ax=ax, location="bottom", extend="min", fraction=0.06, pad=0.01, aspect=80)
    bar.set_label("headroom (bits below the format's max)" + (f"; black line: alert_bits {alert_bits:g}"
                                                               if alert_bits is not None else ""))
    if alert_bits is not None:
        bar.ax.axvline(alert_bits, color="black", lw=2)
    return mesh


def _scale_used(rows: Sequence[Row] | StepColumns, init_scale: float, restarts: Mapping[int, float] | None = None
                ) -> Callable[[int], float | None]:
    """The loss scale a step ran with: the one ``restarts`` names for it (:func:`scale_restarts`:
    a rollback's or a resume's), else the scale after the step before it (the row before's
    ``scaler_scale``), ``init_scale`` for the run's first.

    Example::

        >>> rows = [Row(1, 0.1, 1.0, 1.0, 0.5, False, "", 1024.0), Row(2, 0.1, None, None, 0.5, True, "x", 512.0)]
        >>> scale = _scale_used(rows, 2048.0)
        >>> scale(1), scale(2), scale(3), scale(9)
        (2048.0, 1024.0, 512.0, 512.0)
        >>> _scale_used(rows, 2048.0, {3: 64.0})(3)  # (a resume at step 2 set scaler.init_scale 64)
        64.0
    """
    restarts = dict(restarts or {})
    columns = rows if isinstance(rows, StepColumns) else StepColumns.of(rows)  # (one reading: NaN an empty cell)
    steps, scales = columns.steps, columns.scaler_scale
    return lambda step: restarts[step] if step in restarts else (
        (None if math.isnan(scales[i - 1]) else float(scales[i - 1]))
        if (i := int(steps.searchsorted(step))) else init_scale)


def _a_scale(value: Any) -> bool:
    """A loss scale a hand-edited events.jsonl may hold: a finite number > 0 (:func:`finite_number`)."""
    return finite_number(value) and value > 0


def scale_restarts(run_dir: Path | LoggedEvents, rows: Sequence[Row] | StepColumns, init_scale: float) -> dict[int, float]:
    """The steps of a fp16 run whose loss scale was not the one the step before left: after a
    rollback to the checkpoint of step c, the scale after step c (the run's first scale for its
    start); after a resume that changed ``scaler.init_scale``, the new one (:func:`_events_kept`'s
    events, the later one deciding for a step). ``init_scale`` is the config's, which such a resume
    rewrote: the first change's ``old`` is the scale step 1 ran with. Call it for a run with a
    loss scaler only (a bf16 run's resume may set ``scaler.init_scale``: it scales nothing).

    Example::

        >>> import json, shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> rows = [Row(s, 0.1, 1.0, 1.0, 0.5, False, "", 2.0 ** (10 + s)) for s in range(1, 7)]
        >>> events = [{"step": 2, "event": "policy_change", "key": "scaler.init_scale", "old": 65536.0, "new": 64.0},
        ...           {"step": 5, "event": "rollback", "checkpoint": "step-00000003.pt", "updates_undone": 2}]
        >>> _ = (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\\n" for e in events))
        >>> scale_restarts(folder, rows, 64.0)  # (config.yaml holds the resume's 64)
        {1: 65536.0, 3: 64.0, 6: 8192.0}
        >>> shutil.rmtree(folder)
    """
    after = rows.scale_after if isinstance(rows, StepColumns) else {r.step: r.scaler_scale for r in rows}.get
    events = _events_kept(run_dir, lambda e: e.get("event") in ("rollback", "policy_change")
                          and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool))
    changes = [e for e in events if e["event"] == "policy_change" and e.get("key") == "scaler.init_scale"
               and _a_scale(e.get("new"))]
    first = float(changes[0]["old"]) if changes and _a_scale(changes[0].get("old")) else init_scale
    restarts: dict[int, float] = {1: first} if first != init_scale else {}
    for event in events:
        if event["event"] == "rollback" and (to := _checkpoint_step(event)) is not None:
            scale = first if to == 0 else after(to)
        elif event in changes:
            scale = float(event["new"])
        else:
            continue
        if scale is not None:
            restarts[event["step"] + 1] = scale
    return restarts


def headroom_beside(csv_path: Path) -> Path | None:
    """The ``headroom.csv`` beside a per-step CSV, if the run wrote one.

    Example::

        >>> headroom_beside(Path("/nonexistent/steps.csv")) is None
        True
    """
    path = csv_path.parent / HEADROOM_CSV
    return path if path.is_file() else None


def headroom_watched(config: Config, csv_path: Path | None) -> bool:
    """Whether the run's headroom is for its card and ``report`` to say: the monitor on, or a
    ``headroom.csv`` beside its CSV (on earlier: a resume that turned it off keeps its alerts).

    Example::

        >>> from ampguard.config import validate
        >>> headroom_watched(validate({}), None), headroom_watched(validate({"monitor": {"headroom": {"every": 10}}}), None)
        (False, True)
    """
    return bool(config.monitor.headroom.every) or (csv_path is not None and headroom_beside(csv_path) is not None)


# ---------------------------------------------------------------------------- the run card


def _table(rows: list[tuple[str, str]]) -> str:
    """The run card's two-column table, each cell through :func:`~ampguard.errors.table_cell`: a
    ``|`` in a module's or a metric's name, or in an error message, cut the cell in a Markdown
    view (and :func:`read_card` lost the row), review 56d."""
    return "\n".join(["| | |", "|---|---|", *(f"| {table_cell(k)} | {table_cell(v)} |" for k, v in rows)])


def _final_loss(m: RunMonitor) -> str:
    """The run card's final loss: the last applied step's, with its step when a skipped step came after."""
    loss, step = m.final_loss_and_step
    return _fmt(loss) + (f" (step {step}, the last applied)" if step is not None and step != m.steps else "")


def _fmt(x: float | None, spec: str = ".4g") -> str:
    return "n/a" if x is None else format(x, spec)


def write_run_card(path: Path, config: Config, result: RunResult, plot: str | None = None) -> None:
    """``RUN.md``: what a teammate reads first: set-up, outcome, where everything is, why it ended.
    ``plot``: what its ``plot`` row says in place of the file's name (:func:`write_report`: a
    plot being drawn, or one that could not be).

    Example (a card written from a replayed CSV)::

        >>> import torch
        >>> from ampguard.config import validate
        >>> from ampguard.run_folder import RunPaths, RunResult
        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> from ampguard.sinks import CSV_COLUMNS, read_steps_csv
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n"
        ...                         "2,0.1,inf,,0.4,1,non_finite_grad,32768.0\\n3,0.1,0.5,0.5,0.3,0,,32768.0\\n")
        >>> monitor = replay(read_steps_csv(csv_path), init_scale=65536.0)
        >>> paths = RunPaths.existing(folder)
        >>> result = RunResult(ExitCode.OK, monitor, paths, "finished: 3 steps", torch.device("cpu"))
        >>> write_run_card(folder / "RUN.md", validate({"precision": "fp16"}), result)
        >>> card = (folder / "RUN.md").read_text().splitlines()
        >>> card[2], [line for line in card if line.startswith(("| skipped", "| per-step", "| plot", "| precision |",
        ...                                                     "| backend"))]
        ('**finished: 3 steps**', ['| precision | fp16 (autocast on cpu) |', '| backend | cpu |',
                                   '| skipped steps | 1 (non_finite_grad=1) |',
                                   '| per-step CSV | `steps.csv` |', '| plot | not written |'])
        >>> shutil.rmtree(folder)
    """
    folder = result.paths.dir
    name = folder.name if folder is not None else "run"
    text = "\n\n".join([
        f"# Run {name}",
        f"**{result.ended}**",
        "## Set-up\n\n" + _table(_setup_rows(config, result)),
        "## Outcome\n\n" + _table(_outcome_rows(config, result)),
        "## Files\n\n" + _table(_file_rows(config, result, plot)),
    ])
    replace_atomically(path, text + "\n")  # a failed write never leaves the card half-written or empty


def _support_note(config: Config, device: torch.device) -> str | None:
    """The note :meth:`Precision.support` gives the run's precision on ``device`` (emulated,
    slow), or ``None``; ``None`` too for a device this process cannot ask (a card written for a
    GPU on a machine without one).

    Example::

        >>> import torch
        >>> from ampguard.config import validate
        >>> _support_note(validate({"precision": "fp32"}), torch.device("cpu")) is None
        True
    """
    try:
        return Precision(config.precision, device.type).support(device)[1]
    except (RuntimeError, AssertionError):  # (torch.cuda's answers without CUDA)
        return None


def _setup_rows(config: Config, result: RunResult) -> list[tuple[str, str]]:
    """The run card's set-up: how the run was configured (the loss scaler as the run had it on or off)."""
    s, mon = config.scaler, config.monitor
    scaler = (
        f"dynamic: init {s.init_scale:g}, x{s.growth_factor:g} after {s.growth_interval} clean steps, "
        f"x{s.backoff_factor:g} on a skip, floor (min_scale) {s.min_scale:g}" if result.monitor.scaler_enabled
        else "off (scale reported as 1.0)"
    )
    fail = _fail_fast_text(mon, s.min_scale, result.monitor.scaler_enabled, config.precision)
    return [
        ("precision", Precision(config.precision, result.device.type).describe()
                      + (", model compiled (torch.compile)" if config.compile else "")),
        # a precision this device only emulates (the run's one warning line, kept for a teammate reading later)
        *((("precision support", note),) if (note := _support_note(config, result.device)) else ()),
        # PyTorch on ROCm names an AMD GPU "cuda" too: the backend says which it was, with its version
        ("backend", backend_text(result.device)),
        *((("step path", result.path),) if result.path else ()),
        *((("fp8", f"recipe {config.fp8.recipe}; {in_float8(result.fp8_layers)}"),) if config.precision == "fp8"
          else ()),
        *((("float32 under autocast", float32_layers_text(result.autocast_dtypes)),) if result.autocast_dtypes else ()),
        ("loss scaler", scaler),
        ("clipping", _clipping_text(config, result.policy)),
        ("accumulation", f"{counted(config.accumulation_steps, 'micro-batch', 'micro-batches')} per step"),
        # (task.batch_size is per process: the same settings train another global batch on N)
        ("processes", "1" if result.world_size == 1 else
         f"{result.world_size} (torchrun, {config.distributed.strategy}; a step's batch is {result.world_size} x a "
         "process's)"),
        ("optimizer", f"{config.optimizer.name}, lr {config.optimizer.lr:g}, schedule {config.schedule.decay} "
                      f"(warmup {config.schedule.warmup})"),
        ("scheduler on skipped steps", config.scheduler_on_skip),
        ("task", result.task or config.task.name),
        ("faults injected", ", ".join(config.inject) or "none"),
        ("skip-rate alert", f"rolling rate > {mon.alert_rate:g} over {counted(mon.window, 'step')}"),
        ("fail-fast", fail),
        ("rollback triggers", (f"{', '.join(config.rollback.triggers)}: " + (
            f"at most {counted(config.rollback.max, 'rollback')} (rollback.max)" if config.rollback.max
            else "no rollback allowed (rollback.max 0): a trigger stops the run"))
         if config.rollback.triggers else "none (rollback.triggers)"),
        ("headroom telemetry", (f"every {counted(mon.headroom.every, 'step')} against "
                                f"{mon.headroom.format_for(config.precision)}, "
                                f"ALERT below {mon.headroom.alert_bits:g} bits") if mon.headroom.every
         else "off (monitor.headroom.every)"),
        ("seed", str(config.seed)),
    ]


def _fail_fast_text(mon: Any, min_scale: float, scaler_on: bool, precision: str) -> str:
    """The card's fail-fast row: what stops the run, and what was set that stops nothing (a
    ``monitor.fail_after`` with no rate to count above, a ``fail_rate`` of 1: no skip rate is
    above it, the scale-collapse guard of a run with no loss scaler: its scale never moves from
    1.0).

    Example::

        >>> from ampguard.config import MonitorConfig
        >>> _fail_fast_text(MonitorConfig(fail_rate=0.5, fail_after=3), 1.0, True, "fp16")
        'skip rate > 0.5 for 3 consecutive steps -> exit 3'
        >>> _fail_fast_text(MonitorConfig(fail_after=5), 1.0, False, "fp32")
        'off (monitor.fail_rate not set; monitor.fail_after 5 unused)'
        >>> print(_fail_fast_text(MonitorConfig(fail_after=3, fail_on_scale_collapse=True), 1.0, False, "fp32"))
        off (monitor.fail_rate not set; monitor.fail_after 3 unused); scale collapse: n/a (fp32 runs no loss scaler: monitor.fail_on_scale_collapse stops nothing)
        >>> _fail_fast_text(MonitorConfig(fail_after=3, fail_on_scale_collapse=True), 1.0, True, "fp16")
        'off (monitor.fail_rate not set); skipping at the scale floor 1 for 3 steps -> exit 3'
        >>> _fail_fast_text(MonitorConfig(fail_rate=1.0, fail_after=5), 1.0, True, "fp16")
        'off (monitor.fail_rate 1: no skip rate is above 1, it never trips; monitor.fail_after 5 unused)'
    """
    collapse = mon.fail_on_scale_collapse and scaler_on
    if mon.fail_rate is not None and mon.fail_rate < 1:
        fail = f"skip rate > {mon.fail_rate:g} for {counted(mon.fail_after, 'consecutive step')} -> exit 3"
    else:
        unused = (f"; monitor.fail_after {mon.fail_after} unused"
                  if not collapse and mon.fail_after != type(mon).model_fields["fail_after"].default else "")
        why = "not set" if mon.fail_rate is None else f"{mon.fail_rate:g}: no skip rate is above 1, it never trips"
        fail = f"off (monitor.fail_rate {why}{unused})"
    if collapse:
        fail += f"; skipping at the scale floor {min_scale:g} for {counted(mon.fail_after, 'step')} -> exit 3"
    elif mon.fail_on_scale_collapse:
        who = "fp16 with scaler.enabled false" if precision == "fp16" else precision
        fail += f"; scale collapse: n/a ({who} runs no loss scaler: monitor.fail_on_scale_collapse stops nothing)"
    return fail


def _clipping_text(config: Config, policy: Sequence[dict[str, Any]]) -> str:
    """The card's clipping row: each ``max_norm`` with the step it began at, where a resume
    changed it (the last alone misdescribed the steps before it).

    Example::

        >>> from ampguard.config import validate
        >>> config = validate({"max_norm": 0.5})
        >>> _clipping_text(config, []), _clipping_text(config, [{"key": "max_norm", "old": 1.0, "new": 0.5, "step": 20}])
        ('global L2, max_norm 0.5', 'global L2, max_norm 1, 0.5 from step 21')
        >>> _clipping_text(validate({"max_norm": 0}), [{"key": "max_norm", "old": 1.0, "new": 0.0, "step": 20}])
        'global L2, max_norm 1, off from step 21'
    """
    at = [1] + [change["step"] + 1 for change in policy if change["key"] == "max_norm"]
    values = threshold_by_step(at, "max_norm", config.max_norm, policy)
    return "off" if not any(values) else f"global L2, max_norm {threshold_text(at, values)}"


def _outcome_rows(config: Config, result: RunResult) -> list[tuple[str, str]]:
    """The run card's outcome: what the run's monitor counted, and what happened to the run."""
    m = result.monitor
    return [
        ("ended", result.ended),
        ("steps attempted", str(m.steps)),
        ("updates applied", str(m.updates)),
        ("skipped steps", f"{sum(m.skips.values())} ({m.skips_text()})"),
        *((("non-finite losses by rank", origins),) if (origins := m.loss_origins_text()) else ()),
        ("max rolling skip rate", m.max_skip_rate_text),
        ("skip-rate alert episodes", str(m.alert_episodes)),
        *((("headroom alerts", _headroom_alerts(result.paths.dir, config.monitor.headroom.alert_bits)),)
          if headroom_watched(config, result.paths.csv) else ()),
        # (clipping turned off on a resume: the steps clipped before it still count)
        ("clip rate (whole run)", (f"{m.clip_rate:.3f} ({m.clipped} of {counted(m.steps, 'step')} clipped: "
                                   "applied with pre-clip norm > max_norm)"
                                   if clip_threshold(config.max_norm) or m.clipped else "n/a (clipping off)")),
        ("scale health", f"{m.scale_verdict}" + (f" (final scale {_fmt(m.last.get('scaler_scale'), 'g')})"
                                                 if m.scaler_enabled else "")),
        # (a skipped step's loss is not the model's: an all-skipped run's is "n/a" though step 1's was finite)
        ("loss of applied steps", f"first {_fmt(m.first_loss)}, final {_final_loss(m)}, best {_fmt(m.best_loss)}"),
        # (a rollback past every evaluation of the model kept leaves no final: "n/a", its best kept)
        *((f"held-out {name}", f"final {_fmt(m.eval_last.get(name))}, best {_fmt(m.eval_best.get(name))}")
          for name in {**m.eval_last, **m.eval_best}),
        ("rollbacks", "; ".join(result.rollbacks) if result.rollbacks else "none"),
        ("policy changes on resume", "; ".join(result.policy_changes) if result.policy_changes else "none"),
        ("throughput", result.throughput or "not measured (this process trained fewer than two steps)"),
        ("first-skip diagnosis", result.diagnosis or (
            "none (no skipped step)" if config.diagnose.first_skip or config.diagnose.strict
            else "off (diagnose.first_skip)")),
        ("resumed from", f"`{result.resumed_from.name}`" if result.resumed_from else "no (a fresh run)"),
    ]


def _headroom_alerts(run_dir: Path | None, alert_bits: float) -> str:
    """The card's headroom alerts (:func:`headroom_alerts_text`); an event log that does not read
    leaves the row saying so, not the card unwritten."""
    try:
        return headroom_alerts_text(run_dir, alert_bits) if run_dir is not None else "n/a (no run folder)"
    except InputError:
        return "n/a (events.jsonl does not read)"


def _file_rows(config: Config, result: RunResult, plot: str | None = None) -> list[tuple[str, str]]:
    """The run card's files: each by its name in the run folder, or ``not written``; the plot's
    row ``plot`` when given."""
    paths = result.paths

    def written(p: Path | None) -> str:
        return f"`{p.name}`" if p is not None and p.exists() else "not written"

    headroom = paths.dir / HEADROOM_CSV if config.monitor.headroom.every and paths.dir is not None else None
    return [
        ("per-step CSV", written(paths.csv)),
        ("event log (JSON lines)", written(paths.events)),
        *((("headroom CSV", written(headroom)),) if headroom is not None else ()),
        ("plot", plot if plot is not None else written(paths.plot) if config.log.plot
         else "not drawn when the run ended (log.plot false: `ampguard report` draws it)"),
        ("effective config", written(paths.config)),
        ("checkpoints", (f"`checkpoints/` ({len(result.checkpoints)} kept, latest `{result.checkpoints[-1].name}`)"
                         if result.checkpoints else "none written")),
    ]


def _start_scale(rows: list[Row], backoff: float) -> float:
    """The scale a run started with, read off its rows when no config says (a demo's CSV): the
    first finite scale > 0 (the scale after that step), undone by one back-off when that step was
    skipped; 1.0 when no row has one (a scale of 0, negative, nan or empty is no loss scale).

    Example::

        >>> rows = [Row(1, 0.1, 1.0, 1.0, 0.5, False, "", 1024.0), Row(2, 0.1, None, None, None, True, "x", 512.0)]
        >>> _start_scale(rows, 0.5), _start_scale(rows[1:], 0.5)
        (1024.0, 1024.0)
        >>> bad = Row(1, 0.1, 1.0, 1.0, 0.5, False, "", -1.0)
        >>> _start_scale([bad, rows[0]], 0.5), _start_scale([bad], 0.5)
        (1024.0, 1.0)
    """
    for row in rows:
        scale = row.scaler_scale
        if scale is not None and math.isfinite(scale) and scale > 0:
            before = scale / backoff if row.skipped and backoff > 0 else scale
            return before if math.isfinite(before) else scale
    return 1.0


def growth_interval_of(rows: list[Row], init_scale: float) -> int | None:
    """The loss scaler's ``growth_interval``, read off a run's rows when no config says (a
    Lightning plugin's or a Hugging Face callback's CSV): the scaler grows after exactly that many
    applied steps in a row at one scale: the commonest run of applied steps that ends in a growth,
    the longer on a tie (a scale set higher by a resume, after fewer, is one such run, review 47d;
    a rollback that loads the scaler back mid-count makes one longer, review 47f: outvoted),
    counting only runs whose rows are all there (a CSV written every 10th step would read 10x
    too short: review 47e). None when the rows hold no such growth.

    Example (the scale grows after 3 clean steps; a skip restarts the count)::

        >>> scales = [(4.0, False), (4.0, False), (8.0, False), (4.0, True), (4.0, False), (4.0, False),
        ...           (8.0, False), (8.0, False)]
        >>> rows = [Row(i, 0.1, 1.0, 1.0, 0.5, skipped, "x" if skipped else "", scale)
        ...         for i, (scale, skipped) in enumerate(scales, start=1)]
        >>> growth_interval_of(rows, 4.0), growth_interval_of(rows[:2], 4.0), growth_interval_of(rows[::2], 4.0)
        (3, None, None)
    """
    runs: Counter[int] = Counter()
    before, run, last = init_scale, 0, 0
    for row in rows:
        if row.step != last + 1:  # (rows missing, or a CSV that begins later: how many clean steps, unknown)
            run = None
        last, scale = row.step, row.scaler_scale
        if scale is None or not math.isfinite(scale) or row.skipped:
            run = 0
        elif run is not None:
            run += 1
            if scale > before:  # (a growth: the run of clean steps it waited for)
                runs[run] += 1
        if scale is not None and scale != before:  # (the scaler's count starts again at each move)
            run = 0
        before = scale if scale is not None else before
    return max(runs.items(), key=lambda item: (item[1], item[0]))[0] if runs else None


def unobserved_of(csv_path: Path) -> int:
    """The steps ``1..N`` a run's monitor did not observe, as the ``summary.json`` beside its
    ``steps.csv`` says (``unobserved``: a Trainer run resumed from a checkpoint without ampguard's
    state, which observed from step N + 1, :meth:`~ampguard.monitor.RunMonitor.begin_at`); 0
    without one (no file, not JSON, no such count, a run observed from step 1), for another CSV,
    in a folder with a ``config.yaml`` (``ampguard train``'s: it observes every step), and for a
    count past the summary's own ``steps``. ``report`` replays only the rows after it, so its
    counts, rates and alerts are the run card's (it replayed them all: 2 all-skipped steps after
    step 6 were 2/10 and no alert, where the run alerted on 2/4).

    Example::

        >>> import json, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> none = unobserved_of(folder / "steps.csv")
        >>> _ = (folder / "summary.json").write_text(json.dumps({"steps": 10, "unobserved": 6}))
        >>> none, unobserved_of(folder / "steps.csv"), unobserved_of(folder / "other.csv")
        (0, 6, 0)
        >>> _ = (folder / "summary.json").write_text(json.dumps({"steps": 10, "unobserved": 12}))
        >>> unobserved_of(folder / "steps.csv")  # (past its own steps: not taken)
        0
    """
    summary = _summary_of(csv_path)
    steps, total = summary.get("unobserved"), summary.get("steps")
    return steps if whole_number(steps) and whole_number(total) and steps <= total else 0


def thresholds_of(csv_path: Path) -> dict[str, Any]:
    """The thresholds a run's monitor judged by, as the ``summary.json`` beside its ``steps.csv``
    records them (:data:`~ampguard.monitor.THRESHOLDS`; a Hugging Face callback's run: no ``config.yaml``),
    each one its config field takes; {} without (as :func:`unobserved_of`). ``report`` judges by
    them where none is given, so its verdicts are the run card's (review 47h: a run at window 16
    read "stable" on its card, "collapsing" in report, judged at the default 1000).

    Example::

        >>> import json, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> _ = (folder / "summary.json").write_text(json.dumps({"thresholds": {"window": 16, "alert_rate": 7,
        ...                                                                     "growth_interval": 5}}))
        >>> thresholds_of(folder / "steps.csv")  # (an alert rate of 7 is none: left out)
        {'window': 16, 'growth_interval': 5}
    """
    recorded = _summary_of(csv_path).get("thresholds")
    if not isinstance(recorded, dict):
        return {}
    return {name: value for name, key in THRESHOLDS.items()
            if (value := recorded.get(name)) is not None and not isinstance(value, bool) and _in_range(key, value)}


def _summary_of(csv_path: Path) -> dict[str, Any]:
    """The ``summary.json`` beside a ``steps.csv`` with no ``config.yaml`` (a Hugging Face
    callback's run), as a dict; {} without one, for another CSV, or when it is not a JSON object."""
    import json

    folder = csv_path.parent
    if csv_path.name != "steps.csv" or (folder / "config.yaml").exists():
        return {}
    try:
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # (none, not JSON, or nested past the parser: the rows alone)
        return {}
    return summary if isinstance(summary, dict) else {}


REPORT_DRAWS_IT = "`ampguard report` draws it)"
"""How each ``plot`` row of a run card that names no plot ends, before the cell's `` |`` (a plot
killed or failed in the run's end; ``log.plot`` false: :func:`_file_rows`): the row
:func:`card_after_report` rewrites once ``report`` drew it."""
PLOT_BEING_DRAWN = ("not drawn: the run's end was drawing it when this card was written, and did not finish "
                    "(`ampguard report` draws it)")
"""The run card's ``plot`` row while the run's end draws the plot (:func:`write_report`): the card
stays saying so when the drawing never ends (a kill, the OOM killer), until ``report`` draws it
(:func:`card_after_report`)."""
DRAWN_BY_REPORT = "`{}` (drawn after the run by `ampguard report`)"
"""The ``plot`` row :func:`card_after_report` writes in place of one that said the plot was not drawn."""
MAX_CARD_BYTES = 1 << 20
"""A run card larger than this is no card ampguard wrote (a few KiB): ``report`` leaves it alone."""


def card_after_report(paths: RunPaths, png: Path) -> str | None:
    """After ``report`` drew a run folder's plot ``png`` (its ``report.png``): the run card's
    ``plot`` row, where it says the plot was not drawn (:data:`PLOT_BEING_DRAWN`, a plot that
    failed in the run's end, ``log.plot`` false: each says :data:`REPORT_DRAWS_IT`), rewritten to
    name it (:data:`DRAWN_BY_REPORT`), every other byte of the card as it was, the whole card
    replaced at once (:func:`~ampguard.files.replace_atomically`). Review 55o: after a plot killed in
    the run's end, the card said "not drawn" for good beside the ``report.png`` that ``report`` drew.
    Never while a process trains in the folder (:meth:`~ampguard.run_folder.RunPaths.writer`: it
    writes its own card at its end), nor to a card without such a row (one that names a plot, a
    card of another's making, a link). The line ``report`` says: what it did, or why the row could
    not be rewritten; None where it had nothing to do.

    Example (a run whose plot was killed in its end)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> card = "# Run r\\n\\n## Files\\n\\n| | |\\n|---|---|\\n| plot | {} |\\n| effective config | x |\\n"
        >>> _ = (folder / "RUN.md").write_text(card.format(PLOT_BEING_DRAWN), encoding="utf-8")
        >>> _ = (folder / "report.png").write_bytes(b"")
        >>> card_after_report(RunPaths.existing(folder), folder / "report.png").replace(str(folder), "DIR")
        'DIR/RUN.md: its plot row said the plot was not drawn; it names report.png now'
        >>> (folder / "RUN.md").read_text(encoding="utf-8") == card.format(DRAWN_BY_REPORT.format("report.png"))
        True
        >>> card_after_report(RunPaths.existing(folder), folder / "report.png") is None  # (nothing more to do)
        True
        >>> shutil.rmtree(folder)
    """
    card = paths.card
    try:
        if card is None or paths.plot is None or png.resolve() != paths.plot.resolve() or not png.is_file():
            return None
        if card.is_symlink() or not card.is_file() or card.stat().st_size > MAX_CARD_BYTES:
            return None
        lines = card.read_bytes().split(b"\n")
    except OSError:
        return None
    rows = [i for i, line in enumerate(lines)
            if line.startswith(b"| plot | not drawn") and line.endswith(f"{REPORT_DRAWS_IT} |".encode())]
    if len(rows) != 1 or paths.writer() is not None:  # (a live run writes its own card at its end)
        return None
    lines[rows[0]] = f"| plot | {DRAWN_BY_REPORT.format(png.name)} |".encode()
    try:
        replace_atomically(card, b"\n".join(lines))
    except (OSError, DiskFull) as err:
        if not getattr(err, "replaced", False):  # (one whose folder's sync failed after the rename: rewritten)
            why = failed_because(err.error if isinstance(err, DiskFull) else err)
            return f"{card}: its plot row still says the plot was not drawn: it could not be rewritten ({why})"
    return f"{card}: its plot row said the plot was not drawn; it names {png.name} now"


def write_report(config: Config, result: RunResult) -> None:
    """Run card and plot (``log.plot``); a plotting failure is reported, never allowed to lose the
    run card: the card is written first (its ``plot`` row :data:`PLOT_BEING_DRAWN`), then the plot
    drawn, then the card again with the plot's row as it came out (the file's name, or why it
    could not be drawn). Review 55b: the card came after the plot, and a plot killed while drawing
    a long run (the OOM killer: no ``except`` catches it) left no card. What went wrong with the
    plot is an :class:`~ampguard.errors.AmpguardWarning` (``ampguard: warning: ...`` on stderr, as
    every other warning; review 56m: a bare ``warning:`` line on stdout, which a ``2>`` file and a
    grep for ``ampguard: warning`` missed).

    Example (a CSV with no rows yet cannot be plotted; the card is written all the same)::

        >>> import shutil, tempfile, torch
        >>> from ampguard.config import Config
        >>> from ampguard.monitor import RunMonitor
        >>> from ampguard.run_folder import RunPaths, RunResult
        >>> folder = Path(tempfile.mkdtemp())
        >>> from ampguard.sinks import CSV_COLUMNS
        >>> _ = (folder / "steps.csv").write_text(",".join(CSV_COLUMNS) + "\\n")
        >>> result = RunResult(ExitCode.INTERRUPTED, RunMonitor(), RunPaths.existing(folder), "interrupted",
        ...                    torch.device("cpu"))
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     write_report(Config(), result)
        >>> [str(w.message).replace(str(folder), "DIR") for w in said]
        ['could not draw DIR/report.png: DIR/steps.csv: no steps recorded yet, nothing to plot']
        >>> sorted(p.name for p in folder.iterdir())
        ['RUN.md', 'steps.csv']
        >>> shutil.rmtree(folder)
    """
    paths = result.paths
    assert paths.card is not None and paths.plot is not None and paths.csv is not None
    log = LoggedEvents(paths.dir) if paths.dir is not None else None
    if not config.log.plot and paths.plot.is_file() and drawn_by_ampguard(paths.plot):
        # an earlier part's plot (a resume with log.plot false) no longer shows the run: it goes, so
        # the folder's file list and the trackers' upload do not offer it as this run's
        with contextlib.suppress(OSError):
            paths.plot.unlink()
    if not config.log.plot:
        write_run_card(paths.card, config, result)
        return
    write_run_card(paths.card, config, result, PLOT_BEING_DRAWN)
    try:
        plot_run(paths.csv, paths.plot, max_norm=config.max_norm, window=config.monitor.window,
                 alert_rate=config.monitor.alert_rate, fail_rate=config.monitor.fail_rate,
                 min_steps=config.monitor.min_steps,
                 title=f"run {paths.dir.name}" if paths.dir is not None else None,
                 headroom=headroom_beside(paths.csv), alert_bits=config.monitor.headroom.alert_bits,
                 init_scale=config.scaler.init_scale if result.monitor.scaler_enabled else 1.0,
                 scale_floor=config.scaler.min_scale,
                 note=lambda line: warn(line, AmpguardWarning, stacklevel=2),
                 policy=policy_changes_of(log) if log is not None else (), events_dir=log,
                 scaler_on=result.monitor.scaler_enabled)
    except Exception as err:  # noqa: BLE001 - the run's records matter more than its picture
        warn(f"could not draw {paths.plot}: {err}", AmpguardWarning, stacklevel=2)
        # (a `|` in it is escaped with the card's other cells, _table)
        write_run_card(paths.card, config, result, f"not drawn: {first_line(err)} (`ampguard report` draws it)")
        return
    write_run_card(paths.card, config, result)


# ---------------------------------------------------------------------------- the verb


def run(path: str | Path, *, out: str | Path | None = None, max_norm: float | None = None, window: int | None = None,
        alert_rate: float | None = None, fail_rate: float | None = None, min_steps: int | None = None,
        plot: bool = True) -> ExitCode:
    """``ampguard report RUN_DIR|CSV``: draw the plot again and print a summary (``plot=False``,
    ``--no-plot``: the summary alone, no file written, the way a CI log re-judges a run). Thresholds come
    from the run's ``config.yaml`` (beside the CSV) when there is one, else the config defaults;
    each keyword given overrides its setting. ``max_norm`` and ``fail_rate`` only draw their
    lines; ``window``, ``alert_rate`` and ``min_steps`` judge the skip-rate alerts again, and the
    summary says so. The clip rate is the run's, whatever ``max_norm`` says (:func:`run_clip_rate`).
    A run folder's ``report.png`` drawn, its card's plot row that said the plot was not drawn names
    it now (:func:`card_after_report`).

    Example (a run folder without ``config.yaml``: the default thresholds, ``window`` given)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> from ampguard.sinks import CSV_COLUMNS
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n"
        ...                         "2,0.1,inf,,0.4,1,non_finite_grad,32768.0\\n3,0.1,0.5,0.5,0.3,0,,32768.0\\n")
        >>> code = run(folder, window=2)  # doctest: +ELLIPSIS
        note: ... has no config.yaml: alerts judged with the default thresholds where none is given (window 2 (given), alert rate 0.05, min steps 100: ...)...
        summary: steps=3 updates=2 skips=1 (non_finite_grad=1) final_scale=32768 final_loss=0.3
        max rolling skip rate 0.5000 (window 2), alert episodes 1 (re-judged at --window 2), clip rate 0.333, ...
        plot: .../report.png
        >>> code, (folder / "report.png").is_file()
        (<ExitCode.OK: 0>, True)
        >>> code = run(folder, plot=False)  # doctest: +ELLIPSIS
        note: ...
        summary: ...
        max rolling skip rate ...
        plot: not drawn (--no-plot)
        >>> for bad in (folder / "missing.csv", folder):
        ...     try:
        ...         run(bad, out=folder / "plot.svg")
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        no per-step CSV at DIR/missing.csv
        report: --out DIR/plot.svg: the plot is a PNG; name a .png file
        >>> shutil.rmtree(folder)
    """
    from .config import Config, read_run_config

    target = Path(path)
    csv_path = target / "steps.csv" if target.is_dir() else target
    config_path = csv_path.parent / "config.yaml"
    if csv_path.is_dir():  # (review 54n: it said "no per-step CSV at RUN/steps.csv", which is there)
        raise InputError(f"{csv_path} is a folder, not a file: a run folder's per-step CSV steps.csv is a file")
    if not csv_path.is_file():
        raise InputError(f"no per-step CSV at {csv_path}")
    if _is_png(csv_path):  # (it was "the plot X is the CSV itself; refusing to overwrite it")
        raise InputError(f"{csv_path} is a plot, not a per-step CSV: give the run folder or its steps.csv")
    if out is not None and not plot:
        raise InputError("report: --out says where to draw the plot and --no-plot draws none; give one of them")
    png = Path(out) if out else (target / "report.png" if target.is_dir() else target.with_suffix(".png"))
    if plot and out is None and png == csv_path:  # (a CSV named .png: its default plot would be the CSV itself)
        raise InputError(f"report: {csv_path} is named as a plot (.png) but holds no PNG: the plot beside it would be "
                         "the CSV itself; give --out another .png, or --no-plot")
    if plot:
        check_plot_path(png, csv_path, given=out is not None)
    config = read_run_config(config_path) if config_path.is_file() else Config()
    folder = RunPaths.existing(csv_path.parent)
    log = LoggedEvents(csv_path.parent)  # (read once, at its first question: one history for every figure)
    writer = folder.writer_named()
    if writer is not None:  # (a live run, looked at: fine, said)
        _said(f"note: {csv_path.parent} is being written by another process ({writer}): the figures are as of "
              "its last row; the run has not ended")
    elif config_path.is_file() and folder.card.exists() and not folder.card.is_file():  # (a folder, a pipe: no card)
        _said(f"note: {folder.card} is not a file (a folder?): no run card read; how the run ended is not known here")
    elif config_path.is_file() and not folder.card.is_file():  # (a run's card is written at its end, however it ended)
        ends = log.kept(lambda event: event.get("event") == "run_end")
        saved = folder.checkpoints is not None and any(folder.checkpoints.glob("step-*.pt"))
        if ends:  # (it ended, and its card could not be written: a full disk stops every write)
            _said(f"note: {csv_path.parent} has no run card RUN.md: the run ended ({ends[-1].get('message', '?')}), "
                  "its card not written")
        else:
            _said(f"note: {csv_path.parent} has no run card RUN.md and no process is writing it: the run did not end "
                  "(killed, its machine went down, or its disk filled up)" + (
                      "; `ampguard train --resume` goes on from its last checkpoint" if saved else ""))
    # a threshold given holds for the whole run (the run's policy changes of it set aside); max_norm
    # is never overridden here: the clip rate is the run's, under the max_norm each step ran with
    # (--max-norm draws a line)
    given = {key: value for key, value in (("window", window), ("alert_rate", alert_rate), ("fail_rate", fail_rate),
                                           ("min_steps", min_steps)) if value is not None}
    torn: list[str] = []
    rows, extra = read_steps_and_columns(csv_path, torn)
    if not rows:  # (a kill in the first row's write leaves it torn: say so, not only "no steps")
        cut = f" (its one row is torn, a write cut short: {torn[0][:40]!r})" if torn else ""
        raise InputError(f"{csv_path}: no steps recorded{cut}, nothing to report")
    # a Trainer run resumed without ampguard's state observed from step N + 1 (summary.json's `unobserved`):
    # the replay begins there too, so the figures are its card's (the rows of steps 1..N a stock Trainer's
    # callback wrote in the train() before are drawn, not counted)
    unseen = unobserved_of(csv_path)
    judged_rows = [r for r in rows if r.step > unseen] if unseen else rows
    # whether a loss scaler ran: the run's config says (a scale held at its floor 1 moves nothing); with
    # no config, what the CSV shows: a loss scale that moved, and where it started
    scaler_on = config.scaler_on if config_path.is_file() else any(r.scaler_scale not in (None, 1.0) for r in rows)
    init_scale = config.scaler.init_scale if config_path.is_file() else \
        _start_scale(judged_rows or rows, config.scaler.backoff_factor)
    growth_interval, defaults = config.scaler.growth_interval, None
    if not config_path.is_file():  # (a bare CSV, a demo's, has none by design; a Lightning plugin's, a Trainer's)
        recorded = thresholds_of(csv_path)  # (a Trainer callback's summary.json: the run's own)
        config = config.model_copy(update={"monitor": config.monitor.model_copy(update={
            k: v for k, v in recorded.items() if k != "growth_interval"})})
        read = None if not scaler_on or "growth_interval" in recorded else growth_interval_of(judged_rows or rows,
                                                                                              init_scale)
        growth_interval = recorded.get("growth_interval") or read or growth_interval
        whose = f"{target} has no config.yaml" if target.is_dir() else f"{csv_path} has no config.yaml beside it"
        scale = "" if not scaler_on else (
            f"; the scale's health by the growth_interval summary.json records ({growth_interval})"
            if "growth_interval" in recorded else
            f"; the scale's health by the scaler's growth_interval read off the rows ({read}: the clean steps "
            "before each growth)" if read else f"; the scale's health by the default growth_interval "
            f"({growth_interval}: no growth in the rows to read it from)")
        used = ", ".join(f"{name.replace('_', ' ')} {given.get(name, getattr(config.monitor, name)):g}"
                         + (" (given)" if name in given else " (recorded)" if name in recorded else "")
                         for name in ("window", "alert_rate", "min_steps"))
        source = "the thresholds summary.json records" if recorded else "the default thresholds"
        defaults = (f"{whose}: alerts judged with {source} where none is given ({used}: --window, "
                    f"--alert-rate and --min-steps set them){scale}")  # (said with the other notes, once drawn)
    judged = _replay_config(config, given, init_scale, growth_interval)
    # (an alert rate given sets the run's clear-level changes aside too: the level given holds, clamped to it)
    set_aside = set(given) | ({"clear_rate"} if "alert_rate" in given else set())
    policy = ([c for c in policy_changes_of(log) if REPLAYED_POLICY[c["key"]] not in set_aside]
              if config_path.is_file() else [])
    monitor = build_monitor(judged, scaler_enabled=scaler_on)
    if "window" in given and config_path.is_file():  # --window re-judges the skip-rate alerts; the scale's health
        # stays the run's verdict (a CSV without config: no window of the run's is known, the one given is it)
        monitor.health = ScaleHealth(config.monitor.window, monitor.min_scale, init_scale if scaler_on else None,
                                     growth_interval)
    if unseen:
        monitor.begin_at(unseen)
    held = read_held_out(csv_path, rows, extra)  # (once: the replay's metrics, and the reading notes')
    metrics = held.metrics[len(rows) - len(judged_rows):]
    if not config_path.is_file() and len(metrics) > 1:  # (a user's CsvSink(extra_columns=...): a column on every
        every = set.intersection(*(set(m) for m in metrics))  # row is a per-step value, epoch or tokens_seen; a
        metrics = [{k: v for k, v in m.items() if k not in every} for m in metrics]  # held-out metric is sparse)
    # a run judged whole at a later step than its CSV's last row (a copy cut short, `head`): not judged at that row
    # (review 52c: "finished: 30 steps" beside the figures of 10, and the end's judgement made on them), said
    ended = ended_at(folder.card, log)
    whole = finished(folder.card, log) and not cut_short(rows, torn, ended)
    # a bare CSV (a demo's, a CsvSink's): nothing says how its run ended, so the rows are not judged at its end
    # (review 52c: the demo's ALERT at its end was missing from report's count, unsaid)
    unjudged = None if folder.card.exists() or config_path.is_file() or \
        log.kept(lambda event: event.get("event") == "run_end") else (
            f"{csv_path} has no run card or run_end event beside it: its rows are not judged as a finished run's (an "
            "ALERT a short run raises at its end is not counted)")
    monitor = replay(judged_rows, monitor, policy=policy,
                     rollbacks=rollbacks_of(log) if config_path.is_file() else (),
                     finished=whole, metrics=metrics,
                     ends=segment_ends(log) if config_path.is_file() else (),
                     scales=scale_restarts(log, rows, init_scale) if config_path.is_file() and scaler_on
                     else None)
    # a run folder's plot keeps the title the run gave it (write_report)
    title = f"run {target.resolve().name}" if target.is_dir() else None
    mon = judged.monitor
    if plot:
        import_matplotlib()
        plot_run(csv_path, png, max_norm=config.max_norm if max_norm is None else max_norm, window=mon.window,
                 alert_rate=mon.alert_rate, fail_rate=mon.fail_rate, min_steps=mon.min_steps, title=title,
                 headroom=headroom_beside(csv_path),
                 alert_bits=mon.headroom.alert_bits, init_scale=init_scale if scaler_on else 1.0,
                 scale_floor=config.scaler.min_scale, note=lambda line: _said(f"note: {line}"),
                 policy=[c for c in policy if max_norm is None or c["key"] != "max_norm"],  # (--max-norm: one line)
                 events_dir=log if config_path.is_file() else None, scaler_on=scaler_on, unobserved=unseen)
    # the run card's plot row, where it says the plot was not drawn: it names the one drawn now (review 55o)
    carded = card_after_report(folder, png) if plot else None
    run_dir = log if config_path.is_file() else None  # (a bare CSV's: no steps, no max_norm known)
    for note in [n for n in (defaults, unjudged, carded) if n is not None] + reading_notes(
            csv_path, rows, torn, run_dir, extra, config if run_dir else None, policy, unseen, held, ended):
        _said(f"note: {note}")
    if unseen:
        aside = len(rows) - len(judged_rows)
        first = judged_rows[0].step if judged_rows else None
        # (rows that begin later than the monitor did: a resume with the state into a new folder wrote the
        # steps between elsewhere, and the card's counts hold them)
        elsewhere = first is not None and first > unseen + 1
        _said(f"note: {csv_path.parent / 'summary.json'} says steps 1 to {unseen} were not observed (resumed from a "
              f"checkpoint without ampguard's state): the figures cover "
              + (f"the CSV's steps {first} to {monitor.steps}" if judged_rows else "no step")
              + (f"; the run's card counts steps {unseen + 1} to {first - 1} too, written elsewhere" if elsewhere
                 else ", as the run's card")
              + (f"; the CSV's {counted(aside, 'row')} of those steps are drawn, not counted" if aside else ""))
    # the alerts judged under thresholds given here are not the run's: said so
    rejudged = [f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}"
                for flag, value in (("alert-rate", alert_rate), ("window", window), ("min-steps", min_steps))
                if value is not None]
    episodes = f"{monitor.alert_episodes}" + (f" (re-judged at {', '.join(rejudged)})" if rejudged else "")
    _said(f"summary: {monitor.summary()}")
    _said(f"max rolling skip rate {monitor.max_skip_rate_text} (window {mon.window}), "
          f"alert episodes {episodes}, clip rate "
          f"{run_clip_rate(judged_rows, monitor if config_path.is_file() else None) if judged_rows else 'n/a (no step observed)'}, "
          f"scale {monitor.scale_verdict}")
    if held := {**monitor.eval_last, **monitor.eval_best}:  # (as the run card says them)
        _said("held-out " + "; ".join(f"{name} final {_fmt(monitor.eval_last.get(name))}, best "
                                      f"{_fmt(monitor.eval_best.get(name))}" for name in held))
    if config_path.is_file() and headroom_watched(config, csv_path):
        _said(f"headroom alerts {headroom_alerts_text(log, config.monitor.headroom.alert_bits)}")
    if folder.card.is_file():  # why it ended, as train said it (a guard's stop read like a finished run)
        with contextlib.suppress(OSError):
            ended = trainer_card_ended(folder.card, errors="replace")  # (a Trainer's card: its `ended` row)
            if ended == "unknown":  # (compare refuses such a card: here a note, the figures are the CSV's)
                _said(f"note: {folder.card} is no run card ampguard wrote (no line saying how the run ended): "
                      "its end is not known here")
            _said(f"ended: {ended}")
    _said(f"plot: {png}" if plot else "plot: not drawn (--no-plot)")
    return ExitCode.OK


def _said(line: str) -> None:
    """Print one line of ``report``'s, each control character in it written as its escape
    (:func:`~ampguard.errors.visible`, as ``compare`` shows the same text): much of it is the run
    folder's (a metric's name from the CSV header, the card's ``ended`` line, the ``run_end``
    message, the folder's own name), which a downloaded or a teammate's folder may fill with
    escape sequences that clear the screen or rewrite the line (review 55d)."""
    print(visible(line))


def _is_png(path: Path) -> bool:
    """Whether ``path`` starts as a PNG does (a CSV named ``data.png`` is still a CSV)."""
    try:
        with path.open("rb") as f:
            return f.read(len(PNG_MAGIC)) == PNG_MAGIC
    except OSError:
        return False


def _replay_config(config: Config, given: dict[str, Any], init_scale: float,
                   growth_interval: int | None = None) -> Config:
    """The config ``report`` replays a CSV under (through :func:`~ampguard.build.build_monitor`,
    as the run built its monitor): the run's ``config`` with the thresholds ``given``
    (``monitor.*`` keys) in place of its own, and the loss scale starting at ``init_scale`` (the
    floor ``min_scale`` no higher), growing every ``growth_interval`` steps (a CSV's own, read
    off its rows: :func:`growth_interval_of`; else the config's). A given ``alert_rate`` below
    the run's ``monitor.clear_rate`` clears the ALERT at the rate given.

    Example::

        >>> from ampguard.config import validate
        >>> run_config = validate({"monitor": {"window": 50, "alert_rate": 0.2, "clear_rate": 0.1}})
        >>> judged = _replay_config(run_config, {"alert_rate": 0.05}, init_scale=0.5)
        >>> m = judged.monitor
        >>> m.window, m.alert_rate, m.clear_rate, judged.scaler.init_scale, judged.scaler.min_scale
        (50, 0.05, 0.05, 0.5, 0.5)
    """
    monitor = dict(given)
    clear_rate = config.monitor.clear_rate
    if "alert_rate" in given and clear_rate is not None:  # (a clear level above the alert's is no level)
        monitor["clear_rate"] = min(clear_rate, given["alert_rate"])
    scaler = {"init_scale": init_scale, "min_scale": min(config.scaler.min_scale, init_scale),
              "growth_interval": growth_interval or config.scaler.growth_interval}
    # (model_copy, not validate: a start scale read off a CSV may be one no config allows, > 2**128)
    return config.model_copy(update={"monitor": config.monitor.model_copy(update=monitor),
                                     "scaler": config.scaler.model_copy(update=scaler)})


def run_clip_rate(rows: list[Row], monitor: RunMonitor | None = None) -> str:
    """The run's clip rate, as ``report`` prints it, whatever ``--max-norm`` says: with
    ``monitor`` (replayed under the run's own ``max_norm`` from its ``config.yaml``, and the
    policy changes of a resume), the run card's: the steps whose pre-clip norm was above it.
    Without (a CSV with no config beside it: its ``max_norm`` is not known), what the CSV shows:
    the applied steps whose post-clip norm is below the pre-clip one, both finite (with
    clipping off a step writes the two equal); ``n/a`` when no applied step has both. Either
    way a share of all the steps, as the run card's.

    Example (max_norm 1: step 1 clipped, step 2 not, step 3 skipped)::

        >>> rows = [Row(1, 0.1, 2.0, 1.0, 0.5, False, "", 1.0), Row(2, 0.1, 0.5, 0.5, 0.4, False, "", 1.0),
        ...         Row(3, 0.1, float("inf"), None, 0.4, True, "non_finite_grad", 1.0)]
        >>> run_clip_rate(rows), run_clip_rate(rows, replay(rows, max_norm=1e9, scaler_enabled=False))
        ('0.333', '0.000')
        >>> run_clip_rate([Row(1, 0.1, None, 0.5, None, False, "", 1.0)])  # no pre-clip norm (a stock Trainer's)
        'n/a (no pre- and post-clip norms in the CSV)'
    """
    if monitor is not None:
        return f"{monitor.clip_rate:.3f}"
    measured = [r for r in rows if not r.skipped and r.grad_l2_pre_clip is not None and r.grad_l2_post_clip is not None
                and math.isfinite(r.grad_l2_pre_clip) and math.isfinite(r.grad_l2_post_clip)]
    if not measured:
        return "n/a (no pre- and post-clip norms in the CSV)"
    clipped = sum(r.grad_l2_post_clip < r.grad_l2_pre_clip for r in measured)  # type: ignore[operator]
    return f"{clipped / len(rows):.3f}"


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOT_MARK = "ampguard"
"""The first word of the ``Software`` text chunk of every PNG ampguard draws (``report``'s plot,
``compare``'s overlay; :func:`plot_metadata`): what tells a plot it may draw again from someone's
picture it must never overwrite (:func:`drawn_by_ampguard`)."""


def plot_metadata(title: str | None = None) -> dict[str, str]:
    """The text chunks of a PNG ampguard draws (``savefig(metadata=...)``): ``Software`` (the
    mark, :data:`PLOT_MARK` and the version) and, with ``title``, ``Title``.

    Example::

        >>> from ampguard import __version__
        >>> plot_metadata("run a") == {"Software": f"ampguard {__version__}", "Title": "run a"}
        True
    """
    from . import __version__

    return {"Software": f"{PLOT_MARK} {__version__}", **({"Title": title} if title else {})}


def png_text(path: Path) -> dict[str, str] | None:
    """The text chunks (keyword: text) of the PNG at ``path`` that come before its image data,
    where a PNG writer puts them, as Pillow (matplotlib's PNG library) reads them: the chunks up
    to the image data, each one's CRC checked, the picture itself neither read nor decoded.
    ``None`` when the file does not begin as a PNG does; ``{}`` when it does but is broken (a
    chunk cut short, a CRC that does not match, a header no picture has). A keyword written more
    than once is left out. ``OSError`` when it cannot be read (or is no regular file).

    Example (a PNG is its signature, then chunks: length, type, data, CRC)::

        >>> import struct, tempfile, zlib
        >>> def chunk(kind, data):
        ...     return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        >>> header = chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0))  # 1 x 1 pixel, 8-bit grey
        >>> mark, end = chunk(b"tEXt", b"Software\\0ampguard 1"), chunk(b"IDAT", b"...") + chunk(b"IEND", b"")
        >>> with tempfile.TemporaryDirectory() as d:
        ...     png = Path(d) / "a.png"
        ...     _ = png.write_bytes(PNG_MAGIC + header + mark + chunk(b"tEXt", b"Title\\0run a") + end)
        ...     texts = png_text(png)
        ...     _ = png.write_bytes(PNG_MAGIC + header + mark[:-1] + b"?" + end)  # a bad CRC
        ...     bad_crc = png_text(png)
        ...     _ = png.write_bytes(PNG_MAGIC + header + chunk(b"tEXt", b"Software\\0GIMP") + mark + end)
        ...     twice = png_text(png)
        ...     _ = png.write_text("not a picture")
        ...     texts, bad_crc, twice, png_text(png)
        ({'Software': 'ampguard 1', 'Title': 'run a'}, {}, {}, None)
    """
    from PIL import PngImagePlugin

    _regular(path)
    with path.open("rb") as f:
        if f.read(len(PNG_MAGIC)) != PNG_MAGIC:
            return None
        f.seek(0)
        try:
            # (not Image.open: it refuses a picture of more pixels than Image.MAX_IMAGE_PIXELS, a
            # "decompression bomb" it would never decode here, and warns on half as many. A process
            # that sets ImageFile.LOAD_TRUNCATED_IMAGES has Pillow skip the text chunks' CRCs.)
            info = PngImagePlugin.PngImageFile(f).info
        except (SyntaxError, ValueError):  # a CRC, a chunk or a header that is wrong; a text too large
            return {}
        except OSError as err:
            if err.errno is not None:  # the system's: the file cannot be read
                raise
            return {}  # Pillow's own, which has no errno: a chunk cut short
        head_size = f.tell()  # (Pillow stops after the image data's chunk header)
        f.seek(0)
        head = f.read(head_size)
    # a keyword written twice: Pillow keeps its last text, the hand-written reader before it kept
    # the first. Under either rule a program that adds its own Software chunk to ampguard's plot
    # (after the mark under one, before it under the other) would leave it read as ampguard's,
    # to be overwritten; left out, the mark is nobody's
    return {key: str(text) for key, text in info.items() if isinstance(text, str) and _written_once(head, key)}


def _written_once(head: bytes, keyword: str) -> bool:
    """Whether the start of a PNG, ``head``, holds one text chunk (``tEXt``, ``zTXt``, ``iTXt``)
    of ``keyword``: its chunk type, then the keyword and a NUL. (The same bytes inside another
    chunk's data count too: a keyword is then left out that need not be, never kept wrongly.)

    Example::

        >>> _written_once(b"...tEXtTitle\\0a...tEXtSubTitle\\0b", "Title"), _written_once(b"tEXtA\\0x iTXtA\\0", "A")
        (True, False)
    """
    name = keyword.encode("latin-1") + b"\0"
    return sum(head.count(kind + name) for kind in (b"tEXt", b"zTXt", b"iTXt")) == 1


def drawn_by_ampguard(path: Path) -> bool:
    """Whether ``path`` is a PNG that carries ampguard's mark (:data:`PLOT_MARK`, in its
    ``Software`` text): a plot ``report`` or ``compare`` drew, which either may draw again.
    Not a PNG, another program's, or unreadable: no.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "b.png").write_bytes(PNG_MAGIC + b"...")  # a PNG, without the mark
        ...     drawn_by_ampguard(Path(d) / "b.png"), drawn_by_ampguard(Path(d) / "c.png")
        (False, False)
    """
    try:
        return _marked(png_text(path))
    except OSError:
        return False


def _marked(texts: dict[str, str] | None) -> bool:
    """Whether a PNG's text chunks (:func:`png_text`) carry ampguard's mark."""
    software = (texts or {}).get("Software", "")
    return software == PLOT_MARK or software.startswith(PLOT_MARK + " ")


def plotted_run(png: Path) -> Path | None:
    """The run folder whose own plot ``png`` is: a ``report.png`` in a folder that holds a run's
    ``steps.csv``, ``RUN.md`` or ``config.yaml`` (:class:`~ampguard.run_folder.RunPaths`); else ``None``.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     _ = (Path(d) / "config.yaml").write_text("steps: 1\\n")
        ...     plotted_run(Path(d) / "report.png") == Path(d), plotted_run(Path(d) / "cmp.png")
        (True, None)
    """
    paths = RunPaths.existing(png.parent)
    if png.name != paths.plot.name:  # type: ignore[union-attr]
        return None
    return png.parent if any(p is not None and p.is_file() for p in (paths.csv, paths.card, paths.config)) else None


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # (either missing, or unreadable)
        return False


def check_plot_path(png: Path, csv_path: Path | None, *, given: bool = True, verb: str = "report") -> None:
    """Refuse a plot path that cannot or must not be written, before anything is read or drawn:
    not ``.png``, its folder missing or not writable, a folder, the CSV itself, a run folder's own
    ``report.png`` (:func:`plotted_run`) other than that of the run ``csv_path`` is the
    ``steps.csv`` of, or an existing file that is not a plot ampguard drew
    (:func:`drawn_by_ampguard`: that one is drawn again; anything else is never overwritten). A
    run's own ``report.png`` is drawn again unmarked too: an ampguard that did not mark its plots
    yet drew it. ``given``: the path came from ``--out`` (the message says so), else it is the
    default; ``verb`` the command whose path it is (``report``, ``compare``: no run of its own).

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> _ = csv_path.write_text("step\\n")
        >>> check_plot_path(folder / "report.png", csv_path)  # fine
        >>> for png in (folder / "plot.pdf", folder / "nowhere" / "x.png", folder):
        ...     try:
        ...         check_plot_path(png, csv_path)
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        report: --out DIR/plot.pdf: the plot is a PNG; name a .png file
        report: --out DIR/nowhere/x.png: folder DIR/nowhere does not exist
        report: --out DIR: the plot is a PNG; name a .png file
        >>> _ = (folder / "notes.png").write_text("not a picture")
        >>> _ = (folder / "figure.png").write_bytes(PNG_MAGIC + b"...")  # someone's picture
        >>> _ = (folder / "report.png").write_bytes(PNG_MAGIC + b"...")  # the run's plot, by an older ampguard
        >>> cases = [("notes.png", csv_path, "report"), ("notes.png", folder / "notes.png", "report"),
        ...          ("figure.png", csv_path, "report"), ("report.png", csv_path, "report"), ("report.png", None, "compare")]
        >>> for name, data, verb in cases:  # the fourth: the run's own plot, reporting that run (fine)
        ...     try:
        ...         check_plot_path(folder / name, data, verb=verb)
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        report: --out DIR/notes.png exists and is not a PNG; refusing to overwrite it
        report: --out DIR/notes.png is the CSV itself; refusing to overwrite it
        report: --out DIR/figure.png exists and is not a plot ampguard drew; refusing to overwrite it
        compare: --out DIR/report.png is the plot of the run in DIR; name another file
        >>> shutil.rmtree(folder)
    """
    where = f"{verb}: --out {png}" if given else f"{verb}: the plot {png}"
    if png.suffix.lower() != ".png":
        raise InputError(f"{where}: the plot is a PNG; name a .png file")
    check_folder_of(png, where)
    parent = png.parent
    if png.is_dir():
        raise InputError(f"{where} is a folder")
    if png.is_symlink():  # (dangling or not: what it points at is not the plot's to replace)
        raise InputError(f"{where} is a symbolic link; refusing to overwrite it")
    exists = png.exists()
    if exists and csv_path is not None and png.resolve() == csv_path.resolve():
        raise InputError(f"{where} is the CSV itself; refusing to overwrite it")
    if exists and not png.is_file():
        raise InputError(f"{where} exists and is not a regular file (a pipe, a device); refusing to write it")
    run_dir = plotted_run(png)
    own = run_dir is not None and csv_path is not None and _same_file(RunPaths.existing(run_dir).csv, csv_path)
    if run_dir is not None and not own:  # (another run's plot, existing or to come, is that run's to draw)
        raise InputError(f"{where} is the plot of the run in {run_dir}; name another file")
    if exists:
        try:
            texts = png_text(png)
        except OSError as err:
            raise InputError(f"{where}: cannot read the existing file ({failed_because(err)})") from None
        if texts is None:
            raise InputError(f"{where} exists and is not a PNG; refusing to overwrite it")
        if not own and not _marked(texts):
            raise InputError(f"{where} exists and is not a plot ampguard drew; refusing to overwrite it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{where}: folder {parent} is not writable")
