"""Where step records go: a small ``Sink`` protocol and the sinks (CSV, console, JSONL,
TensorBoard), a background writer (:class:`BackgroundSink`) and :class:`Sinks`, all of a run's.

A sink receives the step's record with device tensors in it and reads them itself
(``record.values()``, one transfer); the step never waits for a sink's numbers.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import errno
import functools
import importlib.util
import json
import math
import numbers
import os
import re
import stat
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

from .errors import (InputError, RankWarning, brief, counted, failed_because, first_line, has_control, plain_digits,
                     shortened, shown, whole_number, warn)
from .files import DiskFull, disk_full_error, is_temporary, open_to_append, replace_atomically, writing
from .records import LABEL_COLUMNS, SKIP_REASONS, StepRecord, format_number, format_value, record_from, strict_json

if TYPE_CHECKING:  # (this module imports neither at run time: the CLI starts without them)
    import numpy
    import torch

    ExtraValue: TypeAlias = "float | str | torch.Tensor | numpy.generic | None"
else:  # (at run time Any: a string naming torch broke typing.get_type_hints on every sink; review 56m)
    ExtraValue: TypeAlias = Any
"""A value of your own beside a record, ``sink.write(record, {"val_loss": value})``: a number
(an int, a float, a bool), text, a one-element tensor or a NumPy number (read as the number it
holds), or ``None`` (missing). A CSV writes each in its column, a JSONL line holds each, the
trackers and TensorBoard log the numbers (text, a bool and a missing value left out); a value
none of them can hold (a tensor of several values) is refused in one line. (A type for checkers,
review 56e: ``extra`` was annotated numbers only; a sink of your own may take ``Mapping[str, Any]``.)"""

CSV_COLUMNS: tuple[str, ...] = (
    "step", "lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "skipped", "skip_reason", "scaler_scale",
)


def check_column_names(names: Iterable[object], what: str, reserved: Iterable[str] = CSV_COLUMNS) -> tuple[str, ...]:
    """``names`` as a tuple of CSV column names, or one :class:`InputError` line naming the first
    that is not a name (not a string, or empty), repeats an earlier one, or is one of ``reserved``
    (the fixed columns: a second ``loss`` column would be read as the loss). ``what`` says whose
    names they are, for the error.

    Example::

        >>> check_column_names(["val_loss", "val_accuracy"], "CsvSink: extra column")
        ('val_loss', 'val_accuracy')
        >>> for names in (["loss"], ["val_loss", "val_loss"], [""], ["val\\nloss"]):
        ...     try:
        ...         check_column_names(names, "task metric")
        ...     except InputError as err:
        ...         print(err)
        task metric 'loss' is one of the CSV's fixed columns (step, lr, grad_l2_pre_clip, grad_l2_post_clip, loss, skipped, skip_reason, scaler_scale); name it otherwise
        task metric 'val_loss' is named twice
        task metric '' is empty; name it
        task metric 'val\\nloss' holds a control character or a line break; name it otherwise
    """
    reserved = tuple(reserved)
    seen: list[str] = []
    for name in names:
        if not isinstance(name, str):
            raise InputError(f"{what} {name!r} is a {type(name).__name__}, not a name (a string)")
        if not name:
            raise InputError(f"{what} {name!r} is empty; name it")
        if has_control(name):  # (a line break split the header)
            raise InputError(f"{what} {name!r} holds a control character or a line break; name it otherwise")
        if name in reserved:
            raise InputError(f"{what} {name!r} is one of the CSV's fixed columns ({', '.join(reserved)}); "
                             "name it otherwise")
        if name in seen:
            raise InputError(f"{what} {name!r} is named twice")
        seen.append(name)
    return tuple(seen)


@runtime_checkable
class Sink(Protocol):
    """Anything with ``write(record, extra=None)`` and ``close()``.

    A sink may also have ``begin_again(step) -> str | None``: a training loop began again from
    ``step`` (a Hugging Face ``auto_find_batch_size`` retry), so the rows after it that the sink
    holds are an abandoned attempt's. It sets them aside as it can and returns a line that says
    where they went (``None`` when it held none): :class:`CsvSink`, :class:`JsonlSink` and
    :class:`TensorBoardSink` here (and :class:`BackgroundSink`, its inner sink's, after the queued
    records), the tracker sinks (``ampguard.integrations.trackers``).

    Example::

        >>> isinstance(ConsoleSink(), Sink), isinstance(object(), Sink)
        (True, False)
    """

    # (Mapping[str, Any]: a sink of your own typed as the protocol was, Mapping[str, float | None],
    # still is one to a checker; ampguard's own sinks take ExtraValue. Review 56m.)
    def write(self, record: StepRecord, extra: Mapping[str, Any] | None = None) -> None: ...

    def close(self) -> None: ...


def _open_for_append(path: Path) -> IO[bytes]:
    """``path`` opened to append lines, unbuffered: each :func:`_append` is one ``write``
    system call, so a line is in the file (the OS's page cache) the moment it returns and
    survives a SIGKILL of the process; no Python buffer layers to flush. A link to nothing is
    refused: appending through it would create its target, wherever that is. A named pipe no
    process reads is refused too: it is opened without waiting (``O_NONBLOCK``, which the file
    then drops), where a plain open waited for a reader for ever (a fit that never began); one a
    reader holds open is written as a file is. The path is reached as a file replaced whole is
    (:func:`~ampguard.files.open_to_append`): a link of another user's on the way, or at the file,
    that leads to what is not theirs is refused in one line, and the file is opened where the walk
    ends, never through a link put at its name after (review 55d: a teammate's ``events.jsonl``
    linked to root's file had a root resume append to that file)."""
    try:
        if path.is_symlink() and not path.exists():
            raise InputError(f"{shown(path)} is a symbolic link to nothing ({shown(os.readlink(path))}); refusing to "
                             f"write through it")
        path.parent.mkdir(parents=True, exist_ok=True)
        file = open(open_to_append(path, flags=_NO_WAIT), "ab", buffering=0)
    except OSError as err:
        if err.errno == errno.ENXIO and _a_named_pipe(path):
            raise InputError(f"cannot write {shown(path)}: it is a named pipe that no process reads; refusing to "
                             f"wait for one") from None
        raise InputError(f"cannot write {shown(path)}: {failed_because(err)}") from None
    if _NO_WAIT:
        try:
            os.set_blocking(file.fileno(), True)  # (a pipe's reader may be slower than the rows: wait for it)
        except BaseException:
            file.close()
            raise
    return file


_NO_WAIT = getattr(os, "O_NONBLOCK", 0)


def opened_without_waiting(path: str, flags: int) -> int:
    """``open``'s opener: the flags it asks for, and ``O_NONBLOCK`` (how :func:`_open_for_append`
    opens, for a look that writes nothing: Lightning's plugin)."""
    return os.open(path, flags | _NO_WAIT, 0o666)


def _a_named_pipe(path: Path) -> bool:
    """Whether ``path`` is (or links to) a named pipe."""
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def _append(file: IO[bytes], text: str) -> None:
    """Write ``text`` (UTF-8) to an unbuffered file, all of it (a raw write may take part).

    A write that fails after part of ``text`` went in (a disk that fills: the first ``write``
    takes what fits, the next one raises) takes that part back out (``os.ftruncate`` to where the
    line began), so the file never ends in half a line; the error is raised as it came.
    """
    data = text.encode("utf-8")
    written = file.write(data) or 0
    if written != len(data):  # (a regular file takes it all; anything else may not)
        rest = memoryview(data)[written:]
        try:
            while rest:
                if not (took := file.write(rest)):  # a file that takes nothing (a full pipe): never spin
                    raise OSError(errno.EAGAIN, f"the write took none of {len(rest)} bytes")
                written += took
                rest = rest[took:]
        except BaseException:
            _take_back(file, written)
            raise


def _take_back(file: IO[bytes], written: int) -> None:
    """Cut the last ``written`` bytes off ``file`` (appended to, so its offset is its end): the
    part of a line whose write failed. Nothing for a file that cannot be cut (a pipe)."""
    if written:
        with contextlib.suppress(OSError, ValueError):
            os.ftruncate(file.fileno(), file.tell() - written)


# ---------------------------------------------------------------------------- reading steps.csv back

@dataclass
class Row:
    """One line of a per-step CSV, as host values (``None`` for an empty cell).

    Example::

        >>> row = Row(step=2, lr=0.1, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None, loss=0.4,
        ...           skipped=True, skip_reason="non_finite_grad", scaler_scale=32768.0)
        >>> row.skipped, row.grad_l2_post_clip is None, row.record().reason
        (True, True, 'non_finite_grad')
    """

    step: int
    lr: float | None
    grad_l2_pre_clip: float | None
    grad_l2_post_clip: float | None
    loss: float | None
    skipped: bool
    skip_reason: str
    scaler_scale: float | None

    def record(self) -> StepRecord:
        """The row as a record the monitor can observe: a ``SkipLog`` with the reason when the
        row was skipped, else a ``StepLog``.

        Example::

            >>> applied = Row(step=1, lr=0.1, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, loss=0.5,
            ...               skipped=False, skip_reason="", scaler_scale=1.0)
            >>> record = applied.record()
            >>> type(record).__name__, record.skipped, record.values()["grad_l2_post_clip"]
            ('StepLog', False, 1.0)
        """
        return record_from(self.step, vars(self), self.skip_reason if self.skipped else None)


def csv_number(text: str, column: str, where: str) -> float | None:
    """A number cell of steps.csv (``None`` when empty), or one :class:`InputError` line naming
    ``where`` and the ``column``.

    Example::

        >>> csv_number("0.25", "lr", "steps.csv line 2"), csv_number("", "loss", "steps.csv line 2")
        (0.25, None)
        >>> csv_number("0.0\\x0003", "lr", "steps.csv line 2")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: steps.csv line 2: column lr holds '0.0\\x0003', not a number
        >>> csv_number(" 1_0", "loss", "steps.csv line 2")  # (float() reads it: no writer writes it)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: steps.csv line 2: column loss holds ' 1_0', not a number
    """
    if text == "":
        return None
    try:
        if not plain_digits(text) or text != text.strip():  # (float() reads '١.٥', '1_0', ' 1')
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise InputError(f"{where}: column {column} holds {text!r}, not a number") from None


def metric_values(cells: Mapping[str, str], where: str) -> dict[str, float]:
    """A row's cells after the fixed eight (:func:`read_steps_and_columns`' ``extra``) as numbers,
    by column: the held-out metrics, the optimizer labels and empty cells left out. A cell of
    digits alone (an integer extra, :func:`~ampguard.records.format_value`) is an ``int``, exact
    at any size; any other a float, as :func:`csv_number` reads it (``1024.0``, an older run's).

    Example::

        >>> metric_values({"val_loss": "0.5", "val_accuracy": "", "skipped_optimizers": "D"}, "line 2")
        {'val_loss': 0.5}
        >>> metric_values({"tokens": "1152921504606846977", "epoch": "-3", "old": "1024.0"}, "line 2")
        {'tokens': 1152921504606846977, 'epoch': -3, 'old': 1024.0}
    """
    return {name: value for name, cell in cells.items()
            if name not in LABEL_COLUMNS and (value := extra_number(cell, name, where)) is not None}


_WHOLE = re.compile(r"[-+]?[0-9]+")


def extra_number(text: str, column: str, where: str) -> float | None:
    """:func:`csv_number` of an extra column's cell, an integer's digits read as the ``int`` they
    write (``float()`` rounded past 2**53).

    Example::

        >>> extra_number("9007199254740993", "tokens", "line 2"), extra_number("0.5", "val_loss", "line 2")
        (9007199254740993, 0.5)
        >>> extra_number("9" * 5000, "tokens", "line 2")  # (past Python's digits for int(): as before, a float)
        inf
    """
    if _WHOLE.fullmatch(text):
        with contextlib.suppress(ValueError):  # (more digits than int() converts: sys.get_int_max_str_digits)
            return int(text)
    return csv_number(text, column, where)


def read_steps_csv(path: str | Path) -> list[Row]:
    """Parse a per-step CSV (docs/design.md §3); a malformed file raises :class:`InputError`.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n"
        ...                         "2,0.1,inf,,0.4,1,non_finite_grad,32768.0\\n3,0.1,0.5,0.5,0.3,0,,32768.0\\n")
        >>> rows = read_steps_csv(csv_path)
        >>> [(r.step, r.skipped, r.skip_reason, r.grad_l2_pre_clip, r.grad_l2_post_clip) for r in rows]
        [(1, False, '', 2.0, 1.0), (2, True, 'non_finite_grad', inf, None), (3, False, '', 0.5, 0.5)]
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n2,0.1,1.0,1.0,0.5,0,,1.0\\n1,0.1,1.0,1.0,0.5,0,,1.0\\n")
        >>> try:
        ...     read_steps_csv(csv_path)
        ... except InputError as err:
        ...     print(str(err).replace(str(folder), "DIR"))
        DIR/steps.csv line 3: step 1 does not follow step 2
        >>> shutil.rmtree(folder)
    """
    return read_steps_and_columns(path)[0]


def read_steps_and_columns(path: str | Path, torn: list[str] | None = None
                           ) -> tuple[list[Row], list[dict[str, str]]]:
    """:func:`read_steps_csv`'s rows and, from the same one read, each row's cells of the columns
    after the fixed eight (a run's ``val_loss``, the optimizer labels), by column name.

    A last line that does not end in a newline is a row whose write was cut short (a kill, a
    full disk): it is left out, as a resume drops it, and appended to ``torn`` when given (a
    torn row of eight cells would otherwise be read with a truncated number).

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + ",val_loss\\n1,0.1,2.0,1.0,0.5,0,,1.0,0.7\\n")
        >>> rows, extra = read_steps_and_columns(csv_path)
        >>> [r.step for r in rows], extra
        ([1], [{'val_loss': '0.7'}])
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n2,0.1,2.0,1.0,0.5,0,,655")
        >>> torn = []
        >>> [(r.step, r.scaler_scale) for r in read_steps_and_columns(csv_path, torn)[0]], torn
        ([(1, 65536.0)], ['2,0.1,2.0,1.0,0.5,0,,655'])
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,-1\\n")
        >>> read_steps_and_columns(csv_path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: .../steps.csv line 2: scaler_scale -1 is no loss scale (one is >= 0)
        >>> shutil.rmtree(folder)
    """
    extra: list[dict[str, str]] = []
    with _reading(path, torn) as reader:
        return list(_rows(Path(path), reader, extra)), extra


@contextlib.contextmanager
def _reading(path: str | Path, torn: list[str] | None = None) -> Iterator[Iterator[list[str]]]:
    """The rows of the per-step CSV at ``path`` as a ``csv.reader`` reads them, one line at a time
    (:func:`_whole_lines`: a torn last line left out, into ``torn``); a file that is not there,
    does not read, or is no CSV is one :class:`InputError` line."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such CSV file: {path}")
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:  # (a spreadsheet's byte-order mark: read past)
            yield csv.reader(_whole_lines(f, torn))
    except (UnicodeDecodeError, csv.Error) as err:
        raise InputError(f"{path}: not a readable CSV ({err})") from None
    except OSError as err:  # (a file that cannot be read: permissions, an I/O error)
        raise InputError(f"{path}: cannot read it ({failed_because(err)})") from None


LAST_STEP = 2**63 - 1
"""The largest step number a steps.csv may hold (:class:`StepColumns` keeps steps as int64): a run's
steps stop far below (``steps`` is at most 1e9), a row past it is refused as bad input."""


class StepColumns:
    """The columns of a per-step CSV a plot draws, in compact arrays (numpy's, one number a step
    and column: ~50 bytes a step, where a :class:`Row` and its cells took ~650; review 55b: a plot
    of a million steps held 1.2 GB): ``steps`` (int64), ``lr``, ``grad_l2_pre_clip``,
    ``grad_l2_post_clip``, ``loss``, ``scaler_scale`` (float64, NaN for an empty cell: a
    ``scaler_scale`` is never a NaN written, :func:`_rows` refuses one), ``skipped`` (bool) and
    ``reasons`` (uint8: 0 none, else 1 + the index in :data:`~ampguard.records.SKIP_REASONS`).
    :func:`read_step_columns` reads them.

    Example::

        >>> rows = [Row(1, 0.1, 2.0, 1.0, 0.5, False, "", 65536.0), Row(2, 0.1, None, None, 0.4, True,
        ...         "non_finite_grad", 32768.0)]
        >>> columns = StepColumns.of(rows)
        >>> len(columns), columns.steps.tolist(), columns.grad_l2_pre_clip.tolist(), columns.skipped.tolist()
        (2, [1, 2], [2.0, nan], [False, True])
        >>> columns.scale_after(2), columns.reason_steps("non_finite_grad").tolist()
        (32768.0, [2])
    """

    NUMBERS = ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale")

    def __init__(self) -> None:
        from array import array

        self._steps, self._reasons = array("q"), bytearray()
        self._numbers = {name: array("d") for name in self.NUMBERS}

    @classmethod
    def of(cls, rows: Iterable[Row]) -> StepColumns:
        """The columns of ``rows``, one at a time (a stream: none of them kept)."""
        columns = cls()
        add_step, add_reason = columns._steps.append, columns._reasons.append
        adds = [columns._numbers[name].append for name in cls.NUMBERS]
        code = {reason: n for n, reason in enumerate(SKIP_REASONS, start=1)}
        nan = math.nan
        for row in rows:
            add_step(row.step)
            add_reason(code.get(row.skip_reason, 0) if row.skipped else 0)
            for add, value in zip(adds, (row.lr, row.grad_l2_pre_clip, row.grad_l2_post_clip, row.loss,
                                         row.scaler_scale)):
                add(nan if value is None else value)
        columns._seal()
        return columns

    def _seal(self) -> None:
        import numpy as np

        self.steps = np.frombuffer(self._steps, dtype=np.int64) if self._steps else np.zeros(0, np.int64)
        for name, values in self._numbers.items():
            setattr(self, name, np.frombuffer(values, dtype=np.float64) if values else np.zeros(0))
        self.reasons = np.frombuffer(bytes(self._reasons), dtype=np.uint8) if self._reasons else np.zeros(0, np.uint8)
        self.skipped = self.reasons > 0
        del self._reasons

    def __len__(self) -> int:
        return len(self.steps)

    def after(self, step: int) -> StepColumns:
        """The columns of the rows after ``step`` (views of these arrays: nothing copied)."""
        import numpy as np

        first = int(np.searchsorted(self.steps, step, side="right"))
        later = StepColumns.__new__(StepColumns)
        for name in ("steps", "skipped", "reasons", *self.NUMBERS):
            setattr(later, name, getattr(self, name)[first:])
        return later

    def reason_steps(self, reason: str) -> Any:
        """The steps skipped for ``reason``."""
        return self.steps[self.reasons == SKIP_REASONS.index(reason) + 1]

    def scale_after(self, step: int) -> float | None:
        """The ``scaler_scale`` of the row of ``step`` (``None``: no such row, or its cell empty)."""
        import numpy as np

        i = int(np.searchsorted(self.steps, step))
        if i == len(self.steps) or self.steps[i] != step or math.isnan(self.scaler_scale[i]):
            return None
        return float(self.scaler_scale[i])


def read_step_columns(path: str | Path, torn: list[str] | None = None) -> StepColumns:
    """The :class:`StepColumns` of the per-step CSV at ``path``, read as a stream: each row
    checked as :func:`read_steps_csv` checks it (the same :class:`InputError` lines), none kept.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> csv_path = folder / "steps.csv"
        >>> _ = csv_path.write_text(",".join(CSV_COLUMNS) + "\\n1,0.1,2.0,1.0,0.5,0,,65536.0\\n"
        ...                         "2,0.1,inf,,0.4,1,non_finite_grad,32768.0\\n")
        >>> columns = read_step_columns(csv_path)
        >>> columns.steps.tolist(), columns.grad_l2_post_clip.tolist(), columns.skipped.tolist()
        ([1, 2], [1.0, nan], [False, True])
        >>> shutil.rmtree(folder)
    """
    with _reading(path, torn) as reader:
        return StepColumns.of(_rows(Path(path), reader, None))


def _whole_lines(lines: Iterable[str], torn: list[str] | None = None) -> Iterator[str]:
    """``lines`` (a text file's, newlines kept) but a last one that does not end in a newline,
    after the first: a write cut short. It goes into ``torn`` when given.

    Example::

        >>> torn = []
        >>> list(_whole_lines(["step\\n", "1\\r\\n", "2\\n", "3"], torn)), torn, list(_whole_lines(["step"]))
        (['step\\n', '1\\r\\n', '2\\n'], ['3'], ['step'])
    """
    for n, line in enumerate(lines):
        if n and not line.endswith(("\n", "\r")):
            if torn is not None:
                torn.append(line)
            return
        yield line


def _rows(path: Path, reader: Iterator[list[str]], extra: list[dict[str, str]] | None) -> Iterator[Row]:
    """Each row the ``reader`` reads, checked (one :class:`InputError` line naming the line); each
    row's cells after the fixed eight appended to ``extra`` (``None``: not kept, a plot's read)."""
    header = next(reader, None)
    if header is None or header == [""] or header == ["\ufeff"]:  # (no line; a byte-order mark alone)
        raise InputError(f"{path} is empty (no header, no step)")
    if tuple(header[: len(CSV_COLUMNS)]) != CSV_COLUMNS:
        raise InputError(f"{path}: the header is not ampguard's ({','.join(CSV_COLUMNS)})")
    twice = [name for name, n in Counter(header).items() if n > 1]
    if twice:  # (a metric named like a fixed column: which of the two is the loss?)
        raise InputError(f"{path}: the header names {', '.join(map(repr, twice))} more than once")
    fixed, name = len(CSV_COLUMNS), str(path)
    previous = 0
    for line_no, cells in enumerate(reader, start=2):
        where = f"{name} line {line_no}"
        if not cells:  # a blank line (an editor's at the end): no row
            continue
        if len(cells) != len(header):
            raise InputError(f"{where}: {len(cells)} cells, the header has {len(header)}")
        if extra is not None:
            extra.append(dict(zip(header[fixed:], cells[fixed:])))
        cell = dict(zip(CSV_COLUMNS, cells))  # the fixed eight, by position
        try:
            if not (cell["step"].isascii() and cell["step"].isdigit()):  # (int() takes "1_000", " 7", "+7")
                raise ValueError(cell["step"])
            step = int(cell["step"])
        except ValueError:
            raise InputError(f"{where}: step {cell['step']!r} is not a step number (a whole number from 1)") from None
        if step > LAST_STEP:  # (StepColumns holds them as int64)
            raise InputError(f"{where}: step {step} is past the last step number ({LAST_STEP})")
        if step <= previous:
            raise InputError(f"{where}: step {step}, but steps count from 1" if not previous else
                             f"{where}: step {step} twice (a row repeated)" if step == previous else
                             f"{where}: step {step} does not follow step {previous}")
        previous = step
        if cell["skipped"] not in ("0", "1"):
            raise InputError(f"{where}: skipped must be 0 or 1, got {cell['skipped']!r}")
        skipped = cell["skipped"] == "1"
        reason = cell["skip_reason"]
        if (reason not in SKIP_REASONS) if skipped else reason:
            raise InputError(f"{where}: skip_reason {reason!r} does not fit skipped={cell['skipped']}")
        numbers = {c: csv_number(cell[c], c, where) for c in ("lr", "grad_l2_pre_clip", "grad_l2_post_clip", "loss",
                                                              "scaler_scale")}
        scale = numbers["scaler_scale"]
        if scale is not None and not scale >= 0:  # (0 is a real record: a plain GradScaler's that underflowed)
            raise InputError(f"{where}: scaler_scale {cell['scaler_scale']} is no loss scale (one is >= 0)")
        for column in ("grad_l2_pre_clip", "grad_l2_post_clip"):  # (NaN and inf are real: a non-finite gradient's)
            norm = numbers[column]
            if norm is not None and norm < 0:
                raise InputError(f"{where}: {column} {cell[column]} is no norm (one is >= 0, or non-finite)")
        if not skipped:  # (a non-finite loss or gradient is always skipped: no guard applies one)
            for column, what in (("loss", "loss"), ("grad_l2_pre_clip", "gradient norm")):
                value = numbers[column]
                if value is not None and not math.isfinite(value):
                    raise InputError(f"{where}: {column} {cell[column]} on a step not skipped (a non-finite {what} "
                                     "is always skipped)")
        pre, post = numbers["grad_l2_pre_clip"], numbers["grad_l2_post_clip"]
        if pre is not None and post is not None and post > pre:  # (NaN compares False: a skip's inf/nan passes)
            raise InputError(f"{where}: grad_l2_post_clip {cell['grad_l2_post_clip']} is above grad_l2_pre_clip "
                             f"{cell['grad_l2_pre_clip']} (clipping only shrinks a norm)")
        yield Row(step=step, skipped=skipped, skip_reason=reason, **numbers)


def _read_back(path: Path, kept: Iterable[str], refused: str = "cannot resume from it") -> None:
    """One :class:`InputError` line unless ``kept`` (the lines of ``path`` a resume keeps, the
    header first, each a whole line) reads as :func:`read_steps_and_columns` reads a run's
    steps.csv: an append to a row ``report`` refuses would leave a run no one can read back (a
    number cell edited by hand, a NUL in it). ``refused`` ends the line (:func:`_refused`). The
    lines are read one at a time, none kept (review 55b: a resume held a million rows' cells).

    Example::

        >>> _read_back(Path("steps.csv"), [",".join(CSV_COLUMNS) + "\\n", "1,0.1,1,1,0.5,0,,x\\n"])
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: steps.csv line 2: column scaler_scale holds 'x', not a number; cannot resume from it
    """
    extra: list[dict[str, str]] = []
    try:
        for line_no, _ in enumerate(_rows(path, csv.reader(kept), extra), start=2):  # (as the file reads)
            metric_values(extra.pop(), f"{path} line {line_no}")
    except InputError as err:
        raise InputError(f"{err}; {refused}") from None

class RowsEndEarly(InputError):
    """A CSV a resume would append to stops before the checkpoint's step (:meth:`CsvSink.kept_rows`):
    ``last`` is the last step it holds, so the caller can name a checkpoint it does reach."""

    def __init__(self, message: str, last: int) -> None:
        super().__init__(message)
        self.last = last


NONE_WRITTEN = ("a sink was handed None: guard.step() returns None for a micro-batch inside an accumulation "
                "group; write what it returns at the group's end (if record is not None: sink.write(record))")


class _Line:
    """What a ``csv.writer`` over it returns from ``writerow``: the row's line, quoted as the
    csv module quotes it (the writer hands its file the whole line, in one ``write``)."""

    @staticmethod
    def write(line: str) -> str:
        return line


def csv_row(record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> dict[str, str]:
    """The CSV cells of one record: numbers via :func:`format_number`, missing values empty.

    Reads ``record.values()`` (which costs a host sync if the record holds device tensors).

    Example::

        >>> from ampguard.records import SkipLog
        >>> skip = SkipLog(2, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
        ...                scaler_scale=512.0, reason="non_finite_loss")
        >>> row = csv_row(skip, {"val_loss": None})
        >>> row["loss"], row["grad_l2_pre_clip"], row["skipped"], row["skip_reason"], row["val_loss"]
        ('nan', '', '1', 'non_finite_loss', '')
    """
    row = dict(zip(CSV_COLUMNS, _cells(record)))
    row.update((key, _cell(value)) for key, value in (extra or {}).items())
    return row


def check_step_after(who: str, step: int, last: int | None, why: str) -> None:
    """A ``ValueError`` naming ``who`` unless ``step`` is a whole number >= 1 (steps count from 1:
    a loop counting from 0 wrote a row every reader of the file then refused, review 50b) and
    comes after ``last`` (None: nothing written yet): docs/design.md §3, no duplicate steps, for
    the CSV, JSON lines, TensorBoard and tracker sinks alike.

    Example::

        >>> check_step_after("CsvSink x.csv", 3, 2, "")
        >>> check_step_after("CsvSink x.csv", 2, 2, "each row's step must follow the one before")
        Traceback (most recent call last):
        ...
        ValueError: CsvSink x.csv: step 2 after step 2: each row's step must follow the one before
        >>> check_step_after("CsvSink x.csv", 0, None, "")
        Traceback (most recent call last):
        ...
        ValueError: CsvSink x.csv: step 0 is not a whole number >= 1 (a record's step counts from 1)
    """
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 1:
        raise ValueError(f"{who}: step {step!r} is not a whole number >= 1 (a record's step counts from 1)")
    if last is not None and step <= last:
        raise ValueError(f"{who}: step {step} after step {last}: {why}")


def step_follows(step: Any, last: int | None) -> bool:
    """:func:`check_step_after`'s usual answer, told without building the refusal's words (the
    sink's name in them: ~3 us a row, review 54f): a plain ``int`` step >= 1 after ``last``. A
    sink calls :func:`check_step_after` when this is false, which raises or (a numpy integer,
    say) passes.

    Example::

        >>> step_follows(3, 2), step_follows(1, None), step_follows(2, 2), step_follows(True, None)
        (True, True, False, False)
    """
    return type(step) is int and step >= 1 and (last is None or step > last)


def _cell(value: float | str | None) -> str:
    """An extra column's cell: text as it is, a number via :func:`format_value` (an integer's
    digits, a float as :func:`format_number` writes it; None: empty)."""
    return value if isinstance(value, str) else format_value(value)


def _cells(record: StepRecord) -> list[str]:
    """The cells of :data:`CSV_COLUMNS` for one record, in order."""
    v = record.values()
    return [str(record.step), format_number(v["lr"]), format_number(v["grad_l2_pre_clip"]),
            format_number(v["grad_l2_post_clip"]), format_number(v["loss"]), "1" if record.skipped else "0",
            record.reason or "", format_number(v["scaler_scale"])]


def _check_keep_through(keep_through: int | None) -> None:
    """A resume's step to keep rows through, for :class:`CsvSink` and :class:`JsonlSink`: a whole
    number >= 0 (-5 kept no row: every row was cut)."""
    if keep_through is not None and not whole_number(keep_through):
        raise ValueError(f"keep_through must be a step >= 0, got {keep_through!r}")


RESUME, ATTEMPT = "to resume", "for the loop's new attempt"
"""What a log is cut back to a step for (:func:`_cut`'s ``purpose``): a resume from a checkpoint,
or a training loop that began again there (:meth:`_LineFile.begin_again`, ``CsvSink(again=True)``)."""
OFF_LOG = "for the resume"
"""A cut's purpose for a log the resumed run turned off (it neither writes nor reads it): the
rows after the step cut back, and a refusal says it "cannot cut it back for the resume"."""


def _refused(purpose: str, how: str = "from") -> str:
    """The end of a refusal of a log that cannot be cut back for ``purpose`` (:data:`RESUME`:
    ``cannot resume from it``, or ``into``; :data:`ATTEMPT`: a retry's, which resumes nothing).

    Example::

        >>> _refused(RESUME), _refused(RESUME, "into"), _refused(ATTEMPT)
        ('cannot resume from it', 'cannot resume into it', "cannot cut it back for the loop's new attempt")
    """
    return f"cannot resume {how} it" if purpose == RESUME else f"cannot cut it back {purpose}"


def _cannot_use(purpose: str) -> str:
    """What a log whose header (or first line) is not this run's says cannot be done: a resume
    appends to it; another ``purpose`` only cuts it back (:func:`_refused`).

    Example::

        >>> _cannot_use(RESUME), _cannot_use(OFF_LOG)
        ('cannot append', 'cannot cut it back for the resume')
    """
    return "cannot append" if purpose == RESUME else _refused(purpose)


def _was_cut(path: Path, step: int, purpose: str) -> str:
    """How every line about a log a cut was made to begins (the cut made, something after it failed).

    Example::

        >>> _was_cut(Path("run/steps.csv"), 4, RESUME)
        'run/steps.csv was cut back to step 4 to resume'
    """
    return f"{shown(path)} was cut back to step {step} {purpose}"


def _cut(path: Path, kept: bytes | Callable[[IO[bytes]], None], step: int, purpose: str = RESUME) -> None:
    """A resume's cut (or, ``purpose``, a loop's new attempt's: :meth:`_LineFile.begin_again`):
    ``kept`` (bytes, or what writes them: :func:`replace_atomically`'s ``data``) made the whole of the log at ``path`` (``replace_atomically``, through its link: a
    link stays one, its target cut). A cut that cannot be made (a link into a folder this user may
    not write, where the file is rewritten beside itself; a folder on the way swapped for a link)
    is one :class:`InputError` line naming the file and why, the file as it was; a full disk
    stays :class:`DiskFull`. One whose folder could not be synced after the file was replaced
    (``replaced`` on the error, :func:`replace_atomically`) says the file was cut, and its error
    (the :class:`InputError`, or :class:`DiskFull`, its line saying so too) has ``replaced = True``.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> (folder / "steps.jsonl").symlink_to(folder)  # (a link to a folder: no file to cut)
        >>> try:
        ...     _cut(folder / "steps.jsonl", b"", 2)
        ... except InputError as err:
        ...     print(str(err).replace(str(folder.resolve()), "DIR").replace(str(folder), "DIR"))
        cannot cut DIR/steps.jsonl back to step 2 to resume: it links to DIR, a folder, not a regular file; nothing was written
    """
    try:
        replace_atomically(path, kept, through_link=True)
    except DiskFull as full:
        if getattr(full, "replaced", False):  # (the rename made: say the file was cut, a DiskFull still)
            full.args = (f"{_was_cut(path, step, purpose)}, but its folder could not be synced "
                         f"after (disk full: {failed_because(full.error)}): a crash could bring back the rows "
                         "after it",)
        raise
    except OSError as err:
        where = err.filename if err.filename is not None and os.fsdecode(err.filename) != os.fsdecode(path) else None
        why = failed_because(err)
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and where is not None and is_temporary(os.path.basename(where)):
            why = (f"no file can be made beside it in {shown(os.path.dirname(where))} ({why}): "
                   "the file is rewritten whole beside itself, then renamed over the old one")
        elif where is not None:
            why = f"{why} ({shown(where)})"
        if getattr(err, "replaced", False):  # (the rename made: the file is cut, its folder not synced)
            cut = InputError(f"{_was_cut(path, step, purpose)}, but its folder could not be "
                             f"synced after ({why}): a crash could bring back the rows after it")
            cut.replaced = True  # type: ignore[attr-defined]
            raise cut from None
        raise InputError(f"cannot cut {shown(path)} back to step {step} {purpose}: {why}") from None


def _log_identity(path: Path) -> tuple[int, int] | None:
    """What tells whether the file at ``path`` (through its link) was cut: its inode and size
    (``None`` when it cannot be looked at). A cut renames a new, shorter file over it; its
    modification time is left out (a file system that flushes at ``close``, NFS, moves it with
    nothing cut: review 41e)."""
    try:
        found = os.stat(path)
    except (OSError, ValueError):
        return None
    return found.st_ino, found.st_size


@contextlib.contextmanager
def aside_taken_back(kept: tuple[Path, int] | None, path: Path, step: int, purpose: str = ATTEMPT) -> Iterator[None]:
    """Around the cut of the log at ``path`` back to ``step`` (``purpose``: :func:`_cut`) whose rows
    after it :func:`set_aside` copied to ``kept`` (``(copy, rows)``, or ``None``: none). What the
    block does when it fails is judged from the file, not from its error: a log exactly as it was
    (its inode and size, through its link) takes the copy back (the rows not
    left in both files); a log that changed, or an error with ``replaced`` (:func:`_cut`), was cut,
    so the copy stays, the only one of those rows. An error after such a cut that does not say so
    itself (a stop signal aside: it goes on as it came, a note added) becomes one line that says the
    log was cut and where its rows are, of the same class when it is a :class:`DiskFull` (its
    ``path`` and ``error`` kept), else an :class:`InputError`.

    Example::

        >>> import tempfile
        >>> log = Path(tempfile.mkdtemp()) / "steps.csv"
        >>> _ = log.write_text("step,lr\\n1,0.1\\n2,0.1\\n")
        >>> kept = set_aside(log, 1, header=True)
        >>> try:
        ...     with aside_taken_back(kept, log, 1):
        ...         _ = log.write_text("step,lr\\n1,0.1\\n")  # (the cut)
        ...         raise OSError(24, "Too many open files")
        ... except InputError as err:
        ...     print(str(err).replace(str(log), "steps.csv"))
        steps.csv was cut back to step 1 for the loop's new attempt (its 1 row after it moved to steps.attempt-1.csv), but then: Too many open files
        >>> kept[0].read_text()
        'step,lr\\n2,0.1\\n'
    """
    before = _log_identity(path) if kept is not None else None
    try:
        yield
    except BaseException as err:
        if kept is None:
            raise
        replaced = getattr(err, "replaced", False)
        if not replaced and before is not None and _log_identity(path) == before:  # as it was: nothing was moved
            with contextlib.suppress(OSError):  # (the error said is the cut's)
                kept[0].unlink(missing_ok=True)
            raise
        where = f"its {counted(kept[1], 'row')} after it moved to {kept[0].name}"
        if not isinstance(err, Exception):  # (a stop signal: it stays one, the process ends as it asks)
            with contextlib.suppress(Exception):
                err.add_note(f"ampguard: {_was_cut(path, step, purpose)}; {where}")
            raise
        if replaced and isinstance(err, InputError):  # (_cut's own line: the file was cut, not synced)
            raise
        if isinstance(err, DiskFull):
            said = first_line(err)
            err.args = (f"{said}; {where}" if replaced else
                        f"{_was_cut(path, step, purpose)} ({where}), but then: {said}",)
            raise
        why = failed_because(err)
        raise InputError(f"{_was_cut(path, step, purpose)} ({where}), but then: {why}") from None


class _LineFile:
    """A file that lines are appended to, each in the file when its call returns (one ``write``
    system call on an unbuffered file, :func:`_append`): what survives a SIGKILL is every line
    written. The base of :class:`CsvSink` and :class:`JsonlSink` (``path`` and ``_file`` set
    by them)."""

    path: Path
    _file: IO[bytes] | None
    _header = False  # (a CSV's first line is its header)

    def _existing(self, append: bool, keep_through: int | None) -> bool:
        """Whether ``self.path`` already holds something: refused unless ``append`` (a resume's
        ``keep_through`` is checked first, :func:`_check_keep_through`)."""
        _check_keep_through(keep_through)
        try:
            if self.path.is_dir():
                raise InputError(f"{shown(self.path)} is a folder: give the file to write (e.g. "
                                 f"{shown(self.path / 'steps.csv')})")
            existing = self.path.exists() and self.path.stat().st_size > 0
        except OSError as err:  # (a name too long, a folder this user may not search: one line)
            raise InputError(f"cannot write {shown(self.path)}: {failed_because(err)}") from None
        if existing and not append:
            raise InputError(f"{shown(self.path)} already exists; refusing to overwrite it")
        return existing

    def _cut_for_append(self, keep_through: int | None, purpose: str = RESUME) -> None:
        """An existing file appended to: its lines after ``keep_through`` cut (a resume, or
        ``purpose``: :data:`ATTEMPT`), else only a torn last line (:meth:`_drop_torn_tail`)."""
        if keep_through is not None:
            self._truncate_after(keep_through, purpose)
        else:
            self._drop_torn_tail()

    def _truncate_after(self, step: int, purpose: str = RESUME) -> None:
        raise NotImplementedError

    def _drop_torn_tail(self) -> None:
        """An existing file appended to without ``keep_through``: a last line with no newline (a
        kill mid-write) is cut off, with a warning, so the next line starts a line of its own; it
        finished the torn one (a CSV row of 12 cells, a JSON line that is no JSON). The file is
        read from its end only."""
        with self.path.open("rb") as f:
            end = f.seek(0, os.SEEK_END)
            at, tail = end, b""
            while at > 0 and b"\n" not in tail:
                at = max(0, at - (1 << 16))
                f.seek(at)
                tail = f.read(end - at)
        if not tail or tail.endswith(b"\n"):
            return
        keep = at + tail.rfind(b"\n") + 1
        try:  # (written as the rows are: through the checked walk, never another user's link, _open_for_append)
            fd = open_to_append(self.path)
        except OSError as err:
            raise InputError(f"cannot write {shown(self.path)}: {failed_because(err)}") from None
        with writing(self.path), open(fd, "ab", buffering=0) as f:
            if keep == 0 and self._header:  # the header alone, its newline never written (checked whole): finish it
                f.write(b"\n")
                return
            if os.fstat(fd).st_size > keep:  # (only ever shorter: a file made anew meanwhile is not padded)
                os.ftruncate(fd, keep)
        # (this process's own file, a loop's may be rank 1's: said by the rank that holds it, RankWarning)
        warn(f"{self.path}: its last line was torn ({counted(end - keep, 'byte')} without a newline: a "
             "kill mid-write?): cut off before appending", RankWarning, stacklevel=2)

    def _write_line(self, line: str) -> None:
        """Append ``line`` (:class:`DiskFull` when there is no room)."""
        if self._file is None:  # (an assert: gone under python -O, then an AttributeError on None)
            raise ValueError(f"{type(self).__name__} {self.path} is closed: nothing more can be written to it")
        with writing(self.path):
            _append(self._file, line)

    def begin_again(self, step: int) -> str | None:
        """The loop began again from ``step`` (a Hugging Face ``auto_find_batch_size`` retry): the
        rows after it, the abandoned attempt's, move to ``<stem>.attempt-N<suffix>``
        (:func:`set_aside`) and the file goes on after ``step``, one row a step. A line that says
        so, or ``None`` when there were none. One that fails (the file closed, read, cut or opened
        again) takes the copy back when the file is as it was (:func:`aside_taken_back`, judged from
        the file); a file that was cut all the same (its folder not synced after: ``replaced``; or
        a stop signal, an error after the rename) keeps its rows in the copy, and the error says
        so. Either way the file is open again after, where it can be: rows go on after its last."""
        kept = set_aside(self.path, step, header=self._header)
        if kept is None:
            return None
        try:  # (a cut that cannot be made: one line, and the rows it set aside not left twice)
            with aside_taken_back(kept, self.path, step):
                self.close()
                # cut where set_aside began: at the first row after step (JSON lines: events of your own,
                # lines without a step, stay before it and moved with the records after it)
                lines = self.path.read_bytes().splitlines(keepends=True)
                before = lines[:_first_after(lines, step, header=self._header)]
                _cut(self.path, b"".join(line for line in before if line.endswith(b"\n")), step, ATTEMPT)
                self._file = _open_for_append(self.path)
        except BaseException:
            if self._file is None:  # (as it was, or cut: rows go on after its last)
                with contextlib.suppress(OSError, InputError):  # (the error said is the cut's)
                    self._file = _open_for_append(self.path)
            raise
        return f"{self.path.name}'s {counted(kept[1], 'row')} after it moved to {kept[0].name}"

    def sync(self) -> None:
        """Make every line written so far durable (``fsync``): before a checkpoint is saved (it is
        fsync'ed itself), so a machine that goes down keeps the rows up to the checkpoint's step,
        which a resume needs. Nothing for a file that cannot be synced (a pipe)."""
        if self._file is None:
            return
        try:
            with writing(self.path):  # (no room: DiskFull, as a write)
                os.fsync(self._file.fileno())
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EROFS):  # (what cannot be synced)
                raise

    def close(self) -> None:
        """Close the file. Every line is in it already (nothing is buffered); a file system that
        reports a write error only at close (NFS, quotas) gives :class:`DiskFull` here."""
        if self._file is not None:
            file, self._file = self._file, None
            with writing(self.path):
                file.close()

    def __enter__(self) -> _LineFile:
        """``with CsvSink(path) as log:`` closes it on the way out."""
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CsvSink(_LineFile):
    """The per-step CSV of docs/design.md §3: one row per step, flushed when written.

    The header is the eight fixed columns, then ``extra_columns`` (declared up front, so the
    file is never rewritten when a value first appears; an empty, repeated or fixed column's name
    is refused: :func:`check_column_names`). ``append=True`` continues an existing
    file whose header matches, without writing a second header; otherwise an existing file is
    an error, never overwritten. ``keep_through`` (with ``append``, a resume) drops the rows
    after that step first; ``again``: for a training loop that began again there (a Hugging Face
    ``auto_find_batch_size`` retry, its rows after the step :func:`set_aside` first), not a
    resume: what a cut that cannot be made says.

    Example::

        >>> import tempfile
        >>> from ampguard.records import StepLog
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = Path(tmp.name) / "steps.csv"
        >>> sink = CsvSink(path, extra_columns=["val_loss"])
        >>> log = StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0)
        >>> sink.write(log, {"val_loss": 0.75})
        >>> sink.close()
        >>> print(path.read_text(), end="")
        step,lr,grad_l2_pre_clip,grad_l2_post_clip,loss,skipped,skip_reason,scaler_scale,val_loss
        1,0.1,2.0,1.0,0.5,0,,1.0,0.75
        >>> CsvSink(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: ...steps.csv already exists; refusing to overwrite it
        >>> tmp.cleanup()
    """

    _header = True

    def __init__(
        self,
        path: str | os.PathLike,
        extra_columns: Sequence[str] = (),
        *,
        append: bool = False,
        keep_through: int | None = None,
        again: bool = False,
    ) -> None:
        self.path = Path(path)
        extra = (extra_columns,) if isinstance(extra_columns, str) else extra_columns
        self.columns = CSV_COLUMNS + check_column_names(extra, "CsvSink: extra column")
        self._open(append, keep_through, "this run's columns", ATTEMPT if again else RESUME)
        self._extra = self.columns[len(CSV_COLUMNS):]
        self._extra_names = frozenset(self._extra)  # (what write() may be given besides the record)
        self._labels = any(c in LABEL_COLUMNS for c in self._extra)
        self._last = _last_step(self.path) if append else None  # each row's step after the one before


    def _open(self, append: bool, keep_through: int | None, expected: str, purpose: str = RESUME) -> None:
        """Open ``self.path`` for rows of ``self.columns``: a new file gets the header; an existing
        one is refused unless ``append``, and then its header must match (``expected`` names what
        it should be, for the error) and its rows after ``keep_through`` are dropped (``purpose``:
        what for, :func:`_cut`)."""
        existing = self._existing(append, keep_through)
        if existing:
            self.check_header(self.path, self.columns, expected)
            self._cut_for_append(keep_through, purpose)
        made = not (self.path.exists() or self.path.is_symlink())
        self._file: IO[bytes] | None = _open_for_append(self.path)
        self._writer = csv.writer(_Line, lineterminator="\n")
        if not existing:
            try:
                self._append_row(self.columns)
            except DiskFull:  # a file it made and could not write is not left behind (empty: refused next time)
                self._file.close()
                self._file = None
                if made:
                    self.path.unlink(missing_ok=True)
                raise
        self.rows = 0

    @staticmethod
    def check_header(path: Path, columns: tuple[str, ...], expected: str, purpose: str = RESUME) -> None:
        """One :class:`InputError` line unless the CSV at ``path`` (if any) has the header
        ``columns`` (``expected`` names them, for the error; ``purpose``: what it is read for,
        :func:`_cannot_use`). A resume checks every file it
        appends to before it cuts any (``Trainer``): a refused resume changes none of them.

        Example::

            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp()) / "steps.csv"
            >>> _ = path.write_text("step,lr\\n1,0.1\\n")
            >>> CsvSink.check_header(path, ("step", "lr"), "")
            >>> CsvSink.check_header(path, ("step", "loss"), "step, loss")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ampguard.errors.InputError: ...steps.csv: its header does not match step, loss, cannot append
            >>> _ = path.write_text("\\ufeffstep,lr\\n1,0.1\\n", encoding="utf-8")
            >>> CsvSink.check_header(path, ("step", "lr"), "step, lr")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ampguard.errors.InputError: ...: its header does not match step, lr (it starts with a byte-order mark: saved again by a spreadsheet?), cannot append
        """
        if not _has_lines(path):
            return
        try:
            with path.open(newline="", encoding="utf-8") as f:
                header = tuple(next(csv.reader(f), ()))
        except (UnicodeDecodeError, csv.Error) as err:
            raise InputError(f"{path}: not a CSV this run wrote ({first_line(err)}), {_cannot_use(purpose)}") from None
        if header != columns:
            bom = header[:1] and header[0].startswith("\ufeff")  # (report reads past one; an append cannot)
            said = " (it starts with a byte-order mark: saved again by a spreadsheet?)" if bom else ""
            raise InputError(f"{path}: its header does not match {expected}{said}, {_cannot_use(purpose)}")

    def begin_again(self, step: int) -> str | None:
        before = _log_identity(self.path)
        try:
            said = super().begin_again(step)
        except BaseException:
            if _log_identity(self.path) != before:  # (cut all the same: the next row follows the last one kept)
                self._last = _last_step(self.path)
            raise
        if said is not None:
            self._last = _last_step(self.path)  # (the next row follows the last one kept)
        return said

    def _append_row(self, cells: Iterable[str]) -> None:
        """One CSV line, in the file when this returns (:class:`DiskFull` when there is no room)."""
        self._write_line(self._writer.writerow(cells))

    def _truncate_after(self, step: int, purpose: str = RESUME) -> None:
        """Drop rows after ``step`` (written after the checkpoint a run resumes from), atomically,
        so the resumed run appends without duplicate steps. A torn last line goes too.

        Every line up to the first row after ``step`` is checked before the file is touched: one
        that is not a row of this CSV (bytes that are not UTF-8, the wrong number of cells, a
        step that is not a whole number in ASCII digits) is one :class:`InputError` line, and the
        file stays as it was (never a traceback; never rows the resumed run kept, cut).

        Example::

            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp()) / "steps.csv"
            >>> _ = path.write_bytes(b"step,lr\\n1,0.1\\n2,0.1\\n3,0.1\\n4,0.")
            >>> sink = CsvSink.__new__(CsvSink)
            >>> sink.path, sink.columns = path, ("step", "lr")
            >>> sink._truncate_after(2)
            >>> path.read_bytes()
            b'step,lr\\n1,0.1\\n2,0.1\\n'
            >>> _ = path.write_bytes(b"step,lr\\n1,0.1\\n\\xb2,0.\\xff\\n3,0.1\\n")
            >>> try:
            ...     sink._truncate_after(2)
            ... except InputError as err:
            ...     print(str(err).replace(str(path), "steps.csv"))
            steps.csv line 3: not UTF-8 text (byte 0xb2 at column 1), cannot resume from it
            >>> path.read_bytes()  # as it was
            b'step,lr\\n1,0.1\\n\\xb2,0.\\xff\\n3,0.1\\n'
        """
        self.cut_after(self.path, len(self.columns), step, purpose)

    @staticmethod
    def cut_after(path: Path, width: int, step: int, purpose: str = RESUME,
                  read_back: Callable[[Path, Iterable[str], str], None] | None = None) -> None:
        """The rows of the CSV at ``path`` (``width`` cells each) after ``step`` dropped, as
        :meth:`_truncate_after` drops them, each kept one checked by ``read_back`` if given
        (:meth:`kept_rows`): for a log a resume cuts back but does not append to (``headroom.csv``
        when the resumed run has the monitor off: its rows after the step are of the abandoned
        timeline). A CSV that is a link stays one, its target cut."""
        with path.open("rb") as f:
            prefix = _kept_lines(path, f, width, step, None, purpose, read_back, None)
        if prefix is not None:  # (the kept lines are the file's first bytes, as is usual: copied from it, not held)
            _cut(path, functools.partial(_copy_head, path, prefix), step, purpose)
            return
        kept = bytearray()  # (a blank line among them, a header made whole: read again, the lines kept joined)
        with path.open("rb") as f:
            _kept_lines(path, f, width, step, None, purpose, read_back, kept.extend)
        _cut(path, bytes(kept), step, purpose)

    @staticmethod
    def kept_rows(path: Path, width: int, step: int, first: int | None = None, purpose: str = RESUME,
                  read_back: Callable[[Path, Iterable[str], str], None] | None = None) -> bytes:
        """The bytes of the CSV at ``path`` a resume from ``step`` keeps: the header and the rows
        up to ``step``, each checked (UTF-8, ``width`` cells, an ASCII whole-number step; else
        one :class:`InputError` line); a torn last line and the rows after ``step`` left out.
        ``first``: the rows kept must be every step from ``first`` to ``step``, one each (a run's
        own steps.csv from 1): a row missing, or a step going back, is one line too (appending
        to it would make a CSV that disagrees with the run card, or one ``report`` refuses), and
        each row kept must read as :func:`read_steps_and_columns` reads it (its numbers numbers).
        ``read_back(path, kept, refused)``: how each row kept must read otherwise (another CSV's
        reader, ``headroom.csv``'s; one :class:`InputError` line ending in ``refused`` when one
        does not). Reads only: a resume checks every log with it before it cuts any (``Trainer``).
        ``purpose`` (:func:`_cut`'s): what a refusal says it cannot do, a resume or the loop's new attempt.
        The file is read one line at a time (:func:`_kept_lines`), only the bytes kept held: a
        resume's check of them, :meth:`check_kept_rows`, holds none.

        Example::

            >>> import tempfile
            >>> path = Path(tempfile.mkdtemp()) / "steps.csv"
            >>> def rows(*steps, lr="0.1"):
            ...     return ",".join(CSV_COLUMNS) + "".join(f"\\n{n},{lr},1,1,0.5,0,,1" for n in steps) + "\\n"
            >>> for text in (rows(1, 2, 3, 4), rows(1, 2), rows(1, 3), rows(1, 2, 3, 2), rows(1, 2, 3, lr="0.\\x001")):
            ...     _ = path.write_text(text)
            ...     try:
            ...         print(CsvSink.kept_rows(path, 8, 3, first=1).count(b"\\n"), "lines kept")
            ...     except InputError as err:
            ...         print(str(err).replace(str(path), "steps.csv"))
            4 lines kept
            steps.csv: its rows end at step 2, the checkpoint is at step 3 (rows missing); cannot resume into it
            steps.csv line 3: step 3 where step 2 should be (a row is missing); cannot resume into it
            steps.csv line 5: step 2 where step 4 should be (a step goes back); cannot resume into it
            steps.csv line 2: column lr holds '0.\\x001', not a number; cannot resume from it
        """
        kept = bytearray()
        with path.open("rb") as f:
            _kept_lines(path, f, width, step, first, purpose, read_back, kept.extend)
        return bytes(kept)

    @staticmethod
    def check_kept_rows(path: Path, width: int, step: int, first: int | None = None, purpose: str = RESUME,
                        read_back: Callable[[Path, Iterable[str], str], None] | None = None) -> None:
        """:meth:`kept_rows`' checks, its refusals, and nothing kept: a resume's look at every log
        before it cuts any (``Trainer``), its memory one line's whatever the file's length
        (review 55b: 825 MiB for a million rows)."""
        with path.open("rb") as f:
            _kept_lines(path, f, width, step, first, purpose, read_back, None)

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        """Append one row, :func:`csv_row`'s cells in the header's order, in one unbuffered write:
        in the file when this returns (:class:`DiskFull` when there is no room)."""
        self.check(record, extra)
        if not step_follows(record.step, self._last):  # (the refusal's words only when they may be needed)
            check_step_after(f"CsvSink {self.path}", record.step, self._last,
                             "each row's step must follow the one before (a resume appends after its checkpoint's "
                             "step: CsvSink(path, append=True, keep_through=<that step>) drops the rows after it)")
        row = _cells(record)
        if self._labels or (extra and any(isinstance(v, str) for v in extra.values())):
            cells = {**(record.labels() if self._labels else {}), **(extra or {})}  # declared label columns
            row += [_cell(cells.get(k)) for k in self._extra]
            self._append_row(row)  # (text cells, the optimizers' names or yours: quoted as the csv module quotes)
        else:  # numbers, empty cells and the reasons' identifiers: nothing the csv module would quote (review 54o:
            # a trainer's step without metrics went through csv.writer for its empty metric cells, ~2 us a row)
            if self._extra:
                row += [format_value(extra.get(k)) for k in self._extra] if extra else [""] * len(self._extra)
            self._write_line(",".join(row) + "\n")
        self.rows += 1
        self._last = record.step

    def check(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        """Refuse what :meth:`write` would refuse whatever the rows before it: a record that is
        not one, one with no column for its optimizers' skips, an ``extra`` value no column
        holds. (:class:`BackgroundSink` asks on the caller's thread, before it queues the
        record: the refusal reaches the write that made it.)"""
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if not isinstance(record, StepRecord):
            raise TypeError(f"CsvSink.write() takes a step's record (guard.step()'s StepLog or SkipLog), "
                            f"got a {type(record).__name__}")
        if record.optimizers and not self._labels:  # (a partial skip read as a whole one, which skipped unsaid)
            raise ValueError(f"CsvSink {self.path}: a record of a guard over several optimizers (this step's: "
                             f"{', '.join(record.optimizers)}) needs the columns saying which skipped: "
                             "CsvSink(path, extra_columns=guard.record_columns)")
        for name, value in (extra or {}).items():  # (the csv module quotes it over two lines: a file its own
            if isinstance(value, str) and has_control(value):  # resume, and report, then refused)
                raise ValueError(f"CsvSink {self.path}: column {name!r}'s text {value!r} holds a line break or a "
                                 "control character: one row is one line")
        if extra and not self._extra_names.issuperset(extra):  # (a value no column holds was dropped, unsaid)
            unknown = [k for k in extra if k not in self._extra_names]
            refuse_record_fields(f"CsvSink {self.path}", {k: None for k in unknown if k in CSV_COLUMNS}, "a fixed column")
            raise ValueError(f"CsvSink {self.path}: {', '.join(map(repr, unknown))} not among its columns "
                             f"({', '.join(self._extra) or 'no extra column declared'}): declare each up front, "
                             "CsvSink(path, extra_columns=[...]) (the header is written once)")


def _whole(line: bytes) -> bytes:
    """``line`` ending in its newline.

    Example::

        >>> _whole(b"step,lr"), _whole(b"step,lr\\n")
        (b'step,lr\\n', b'step,lr\\n')
    """
    return line if line.endswith(b"\n") else line + b"\n"


class _Refused(Exception):
    """:func:`_kept_lines`' refusal of a line, carried out past a ``read_back`` reading its lines
    (which would take an :class:`InputError` for its own)."""

    def __init__(self, error: InputError) -> None:
        super().__init__(str(error))
        self.error = error


def _kept_lines(path: Path, f: IO[bytes], width: int, step: int, first: int | None, purpose: str,
                read_back: Callable[[Path, Iterable[str], str], None] | None,
                keep: Callable[[bytes], None] | None) -> int | None:
    """:meth:`CsvSink.kept_rows`' work on ``f`` (the CSV at ``path``, opened), one line at a time:
    each line kept handed to ``keep`` (the header first), and, as it is read, to ``read_back``
    (:func:`_read_back` for a run's own steps.csv, ``first`` given). The refusals are the ones a
    read of the whole file made, in its order: a line that is no row of it before any row
    ``read_back`` refuses, both before :class:`RowsEndEarly`. Returns how many of the file's first
    bytes the kept lines are, or ``None`` where they are not its first bytes (a blank line or a
    header without its newline left out or made whole between them).

    Example::

        >>> import io
        >>> kept = []
        >>> text = b"step,lr\\n1,0.1\\n\\n2,0.1\\n3,0.1\\n4,0."
        >>> _kept_lines(Path("x.csv"), io.BytesIO(text), 2, 2, None, RESUME, None, kept.append), kept
        (None, [b'step,lr\\n', b'1,0.1\\n', b'2,0.1\\n'])
        >>> _kept_lines(Path("x.csv"), io.BytesIO(text.replace(b"\\n\\n", b"\\n")), 2, 2, None, RESUME, None, None)
        20
    """
    refused, into = _refused(purpose), _refused(purpose, "into")
    if first is not None and read_back is None:  # (a run's own steps.csv): each row kept is one report reads
        read_back = _read_back
    found = {"expected": first, "beyond": "", "end": 0, "gap": False, "prefix": True}

    def lines() -> Iterator[bytes]:  # (bytes.splitlines' lines, the whole file's: each chunk ends at a b"\\n")
        for chunk in f:
            yield from chunk.splitlines(keepends=True)

    def kept() -> Iterator[str]:
        numbered = enumerate(lines(), start=1)
        for _, head in numbered:  # (a header its writer's newline never reached: whole)
            whole = _whole(head)
            found["prefix"], found["end"] = whole == head, len(head)
            if keep is not None:
                keep(whole)
            yield whole.decode("utf-8", errors="surrogateescape")
            break
        offset = found["end"]
        for line_no, raw in numbered:
            offset += len(raw)
            if not raw.endswith(b"\n"):  # a torn last line (a write cut short): it goes
                return
            if not raw.strip():  # a blank line (an editor's at the end): no row, as the reader takes it
                found["gap"] = True
                continue
            where = f"{path} line {line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise _Refused(InputError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                          f"{err.start + 1}), {refused}")) from None
            try:
                cells = next(csv.reader([line]), [])
            except csv.Error as err:  # (a cell past the csv module's field limit, 128 KiB)
                raise _Refused(InputError(f"{where}: not a row of this CSV ({err}); {refused}")) from None
            if len(cells) != width:
                raise _Refused(InputError(f"{where}: {len(cells)} cells, the header has {width}; {refused}"))
            if not (cells[0].isascii() and cells[0].isdigit()):
                raise _Refused(InputError(f"{where}: step {cells[0]!r} is not a step number (a whole number from 1), "
                                          f"{refused}"))
            n, expected = int(cells[0]), found["expected"]
            if expected is not None and n != expected and (n <= step or n < expected):
                why = "a row is missing" if n > expected else "a step goes back"
                raise _Refused(InputError(f"{where}: step {n} where step {expected} should be ({why}); {into}"))
            if n > step:
                if expected is not None and n != expected:  # (past the checkpoint's step, but not the next row)
                    found["beyond"] = f" (line {line_no} holds step {brief(n)})"
                return
            if found["gap"]:  # (a blank line left out before it: the kept lines are no longer the file's first)
                found["prefix"] = False
            found["end"] = offset
            if keep is not None:
                keep(raw)
            found["expected"] = None if expected is None else expected + 1
            yield line

    source, deferred = kept(), None
    try:
        if read_back is not None:  # cell by cell, as the lines are read
            try:
                read_back(path, source, refused)
            except InputError as err:  # (said after the lines left are checked: a line that is no row says first)
                deferred = err
        for _ in source:  # (the lines read_back left, or all of them)
            pass
    except _Refused as refusal:
        raise refusal.error from None
    if deferred is not None:
        raise deferred
    expected = found["expected"]
    if expected is not None and expected <= step:
        raise RowsEndEarly(f"{path}: its rows end at step {expected - 1}{found['beyond']}, the checkpoint is at step "
                           f"{step} (rows missing); {into}", expected - 1)
    return found["end"] if found["prefix"] else None


def _copy_head(path: Path, size: int, target: IO[bytes]) -> None:
    """The first ``size`` bytes of the file at ``path`` written to ``target``, a MiB at a time (a
    cut's kept lines, :meth:`CsvSink.cut_after`: never held whole). The file is open only while
    it is copied, closed before the cut renames the copy over it (Windows refuses to rename over
    a file held open: review 55o)."""
    with path.open("rb") as source:
        while size > 0:
            chunk = source.read(min(size, 1 << 20))
            if not chunk:  # (the file shortened meanwhile: what there is)
                break
            target.write(chunk)
            size -= len(chunk)


def _last_step(path: Path, tail: int = 1 << 16, records: bool = False) -> int | None:
    """The step of the last whole row of a per-step CSV (read from its last ``tail`` bytes), None
    when it holds none (or its last line's step does not read: the file's own checks say why);
    ``records``: of the last step record of a JSON lines step log (lines that are none, events
    of yours, passed over).

    Example::

        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "steps.csv"
        >>> _ = path.write_text("step,lr\\n1,0.1\\n12,0.1\\n13,0.")  # (a torn last line: not a row)
        >>> _last_step(path), _last_step(path.with_name("none.csv"))
        (12, None)
        >>> _ = path.write_text('{"step": 4}\\n{"event": "mine"}\\n{"step": 5, "lo')
        >>> _last_step(path, records=True)
        4
    """
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().split(b"\n")[:-1]  # (whole lines: the part after the last newline is torn)
    except OSError:
        return None
    for line in reversed(lines):
        if not line.strip():  # (a blank line at the end: no row, as the reader takes it)
            continue
        if records:
            if (step := _record_step(line)) is not None:
                return step
            continue
        first = line.split(b",", 1)[0]
        return int(first) if first.isdigit() else None
    return None


def console_line(record: StepRecord) -> str:
    """``STEP 5 loss=... pre=... post=... scale=... lr=...`` (``SKIP`` lines add ``reason=``, and
    under torchrun, for a non-finite loss, whose it was: ``reason=non_finite_loss (rank 1)``).

    Reads ``record.values()`` (which costs a host sync if the record holds device tensors).

    Example::

        >>> from ampguard.records import StepLog
        >>> console_line(StepLog(5, lr=0.001, loss=0.25, grad_l2_pre_clip=3.0, grad_l2_post_clip=1.0,
        ...                      scaler_scale=65536.0))
        'STEP 5 loss=0.25 pre=3 post=1 scale=6.554e+04 lr=0.001'
    """
    v = record.values()

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    line = (
        f"{'SKIP' if record.skipped else 'STEP'} {record.step} loss={num(v['loss'])} "
        f"pre={num(v['grad_l2_pre_clip'])} post={num(v['grad_l2_post_clip'])} "
        f"scale={num(v['scaler_scale'])} lr={num(v['lr'])}"
    )
    if record.optimizers:
        line += f" optimizers={','.join(record.optimizers)}"
    if record.skipped:
        line += f" reason={record.reason}"
        if loss_on := getattr(record, "loss_on", None):  # (torchrun: whose own loss it was)
            line += f" ({loss_on})"
        if record.skipped_optimizers:
            line += f" skipped={','.join(record.skipped_optimizers)}"
    return line


RECORD_FIELDS = frozenset(CSV_COLUMNS) | {"loss_on", "optimizers", "skipped_optimizers"}
"""The names a step record's own values take in a sink's row (an extra named so is refused)."""


def refuse_record_fields(who: str, extra: Mapping[str, Any] | None, kind: str = "a field of the record") -> None:
    """A ``ValueError`` naming the ``extra`` values named like the record's own (:data:`RECORD_FIELDS`):
    given beside the record, one overwrote the step's value in the row (review 52d: an extra
    ``loss`` 9.0 in the JSON line and TensorBoard's ``train/loss`` where the step's was 0.5).

    Example::

        >>> refuse_record_fields("JsonlSink steps.jsonl", {"val_loss": 1.0})
        >>> refuse_record_fields("JsonlSink steps.jsonl", {"loss": 9.0, "lr": 7.0})
        Traceback (most recent call last):
        ...
        ValueError: JsonlSink steps.jsonl: 'loss', 'lr' is a field of the record: its value is the record's (guard.step()'s), not one given beside it
    """
    fixed = [name for name in (extra or {}) if name in RECORD_FIELDS]
    if fixed:
        raise ValueError(f"{who}: {', '.join(map(repr, fixed))} is {kind}: its value is the record's "
                         "(guard.step()'s), not one given beside it")


def _json_value(who: str, name: str, value: Any) -> Any:
    """An extra's value as JSON holds it: a NumPy scalar, a one-element NumPy array or tensor as the
    Python number or bool it holds (review 52d: every other sink took them; ``json.dumps`` refused
    them), text, a bool and None as they are; anything else one ``ValueError`` naming the extra
    (review 52i: a raw ``TypeError``, "not JSON serializable", that named no extra).

    Example::

        >>> import numpy as np, torch
        >>> [_json_value("s", "x", v) for v in (np.float32(0.5), np.int64(3), torch.tensor(0.25), torch.tensor([7]),
        ...                                     np.bool_(True), np.array(2.5), 2, True, None, "warm-up")]
        [0.5, 3, 0.25, 7, True, 2.5, 2, True, None, 'warm-up']
        >>> _json_value("JsonlSink s.jsonl", "acc", torch.ones(3))
        Traceback (most recent call last):
        ...
        ValueError: JsonlSink s.jsonl: extra 'acc' is a Tensor of 3 values: a row holds one value a column (a number, a bool, text)
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, numbers.Integral):  # (NumPy's integers)
        return int(value)
    if isinstance(value, numbers.Real):  # (a Fraction: review 52l)
        try:
            return float(value)
        except OverflowError:  # (one past float's range: named, review 52n)
            raise ValueError(f"{who}: extra {name!r} is {shortened(str(value), 40)}, past a float's range") from None
    size = value.numel() if hasattr(value, "numel") and callable(value.numel) else getattr(value, "size", None)
    if size == 1 and callable(getattr(value, "item", None)):  # (a tensor or a NumPy scalar or array of one value)
        item = value.item()
        if isinstance(item, (bool, int, float)):
            return item
    kind = f"a {type(value).__name__}" + (f" of {size} values" if isinstance(size, int) else "")
    raise ValueError(f"{who}: extra {name!r} is {kind}: a row holds one value a column (a number, a bool, text)")


class ConsoleSink:
    """Prints a line every ``every`` steps, and every skipped step whatever ``every`` is.

    Example::

        >>> from ampguard.records import SkipLog, StepLog
        >>> lines = []
        >>> sink = ConsoleSink(every=2, print_fn=lines.append)
        >>> for step in (1, 2):
        ...     sink.write(StepLog(step, lr=0.1, loss=1.0, grad_l2_pre_clip=1.0, grad_l2_post_clip=1.0,
        ...                        scaler_scale=1.0))
        >>> sink.write(SkipLog(3, lr=0.1, loss=float("nan"), grad_l2_pre_clip=None, grad_l2_post_clip=None,
        ...                    scaler_scale=0.5, reason="non_finite_loss"))
        >>> for line in lines:
        ...     print(line)
        STEP 2 loss=1 pre=1 post=1 scale=1 lr=0.1
        SKIP 3 loss=nan pre=- post=- scale=0.5 lr=0.1 reason=non_finite_loss
    """

    def __init__(self, every: int = 1, print_fn: Callable[[str], None] | None = None) -> None:
        if not isinstance(every, numbers.Integral) or isinstance(every, bool) or every < 1:  # (review 52d: 0
            raise ValueError(f"ConsoleSink: every must be a whole number >= 1 (a line every so many steps), "  # failed
                             f"got {every!r}")  # the first write, ZeroDivisionError)
        self.every = int(every)
        self._print = print_fn or (lambda s: print(s, file=sys.stdout, flush=True))

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if record.skipped or record.step % self.every == 0:
            self._print(console_line(record))

    def close(self) -> None:
        pass


class JsonlSink(_LineFile):
    """One JSON object per line, flushed per line: step records (``write``) or plain events
    (``write_event``). Non-finite numbers are written as the strings ``"inf"``/``"nan"`` so
    every line is strict JSON.

    Example::

        >>> import tempfile
        >>> from ampguard.records import SkipLog
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = Path(tmp.name) / "steps.jsonl"
        >>> sink = JsonlSink(path)
        >>> sink.write(SkipLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=None,
        ...                    scaler_scale=0.5, reason="non_finite_grad"))
        >>> sink.write_event({"event": "rollback", "step": 1})
        >>> sink.close()
        >>> first, second = map(json.loads, path.read_text().splitlines())
        >>> first["grad_l2_pre_clip"], first["grad_l2_post_clip"], first["skipped"], first["skip_reason"]
        ('inf', None, True, 'non_finite_grad')
        >>> second
        {'event': 'rollback', 'step': 1}

    ``append=True`` continues an existing file; with ``keep_through`` (a resume of step records)
    its lines after that step are dropped first, as :class:`CsvSink` drops its rows::

        >>> sink = JsonlSink(path, append=True, keep_through=0)
        >>> sink.close()
        >>> path.read_text()
        ''
        >>> tmp.cleanup()
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False, keep_through: int | None = None) -> None:
        self.path = Path(path)
        if self._existing(append, keep_through):
            self._cut_for_append(keep_through)
        self._file: IO[bytes] | None = _open_for_append(self.path)
        self._last = _last_step(self.path, records=True) if append else None  # each record's step after the one before

    def _truncate_after(self, step: int, purpose: str = RESUME) -> None:
        """Drop the lines after ``step`` (written after the checkpoint a run resumes from),
        atomically, so the resumed run appends without duplicate steps (:meth:`cut_after`)."""
        self.cut_after(self.path, step, purpose)

    def begin_again(self, step: int) -> str | None:
        try:
            return super().begin_again(step)
        finally:  # (cut or not: the records go on after the last one the file holds)
            self._last = _last_step(self.path, records=True)

    @classmethod
    def cut_after(cls, path: Path, step: int, purpose: str = RESUME) -> None:
        """The lines of the step log at ``path`` after ``step`` dropped, atomically: from the first
        step record past ``step`` on, and a torn last line. A line of yours that is no step record
        (an event written with ``write_event``) stays where it is before that record (review 52d:
        the cut stopped at it, and the records after it up to ``step`` were lost unsaid).
        A file whose first line is not a step record is no step log: refused (as
        :class:`CsvSink` refuses a header that does not match), and left as it is. For the file
        a resume appends to, and for one it does not (``log.jsonl`` turned off: its lines after
        the step are the abandoned timeline's: ``purpose`` :data:`OFF_LOG`)."""
        cls.check_step_log(path, purpose)
        lines = path.read_bytes().splitlines(keepends=True)
        keep = 0  # how many lines stay
        for line in lines:
            at = _record_step(line)
            if not line.endswith(b"\n") or (at is not None and at > step):
                break
            keep += 1
        _cut(path, b"".join(lines[:keep]), step, purpose)  # (a link stays one)

    @staticmethod
    def check_step_log(path: Path, purpose: str = RESUME) -> None:
        """One :class:`InputError` line unless the file at ``path`` (if any) starts with a step
        record: what a resume appends to (checked before any file is cut, as
        :meth:`CsvSink.check_header`; ``purpose`` as there)."""
        if not _has_lines(path):
            return
        with path.open("rb") as f:
            first = f.readline(1 << 20)
        if _record_step(first) is None:
            raise InputError(f"{path}: its first line is not a step record (a JSON object with an "
                             f"integer \"step\"), {_cannot_use(purpose)}")

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if not step_follows(record.step, self._last):  # (review 50b: 5, 5, 2 went in)
            check_step_after(f"JsonlSink {self.path}", record.step, self._last,
                             "each record's step must follow the one before (a second loop? give it a sink of its own)")
        refuse_record_fields(f"JsonlSink {self.path}", extra)
        self.write_event({
            "step": int(record.step),  # (a numpy integer: JSON has no such type)
            **record.values(),
            "skipped": record.skipped,
            "skip_reason": record.reason,
            **({"loss_on": loss_on} if (loss_on := getattr(record, "loss_on", None)) else {}),
            **({"optimizers": list(record.optimizers), "skipped_optimizers": list(record.skipped_optimizers)}
               if record.optimizers else {}),
            **{name: _json_value(f"JsonlSink {self.path}", name, value) for name, value in (extra or {}).items()},
        })
        self._last = record.step

    def write_event(self, obj: Mapping[str, object]) -> None:
        """Write ``obj`` as one JSON line (non-finite floats as strings) and flush it
        (:class:`DiskFull` when there is no room)."""
        self._write_line(json.dumps(strict_json(dict(obj))) + "\n")


def _has_lines(path: Path) -> bool:
    """Whether a log a resume appends to holds something to check (False: missing or empty); one
    :class:`InputError` line when it is not a file."""
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return False
    if not path.is_file():
        raise InputError(f"{path}: is not a file, cannot append to it")
    return True


def _record_step(line: bytes) -> int | None:
    """The ``step`` of a step record's JSON line (as :class:`JsonlSink` writes it); None for a
    line that is not one (not UTF-8, not JSON, not an object, no integer ``step``: a torn line).

    Example::

        >>> _record_step(b'{"step": 3, "loss": 0.5}\\n'), _record_step(b'{"step": 3, "lo')
        (3, None)
        >>> _record_step(b'{"step": true}\\n'), _record_step(b'{"event": "run_start"}\\n')
        (None, None)
    """
    try:
        obj = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # (UnicodeDecodeError and JSONDecodeError are ValueErrors;
        return None                        # a foreign line nested too deep is a RecursionError)
    step = obj.get("step") if isinstance(obj, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def steps_from(first: int, last: int) -> str:
    """Steps ``first`` to ``last`` in words.

    Example::

        >>> steps_from(3, 3), steps_from(1, 2)
        ('step 3', 'steps 1-2')
    """
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _csv_step(line: bytes) -> int | None:
    """The step of a CSV row (its first cell), None for a line that is not one (the header)."""
    first = line.partition(b",")[0]
    return int(first) if first.isdigit() else None


def set_aside(path: Path, step: int, *, header: bool) -> tuple[Path, int] | None:
    """The step rows of ``path`` (a CSV with its ``header``, or JSON lines) after ``step``,
    copied to ``<stem>.attempt-<N><suffix>`` beside it, the first N free (an earlier one is
    never overwritten), header first: an attempt a Hugging Face ``auto_find_batch_size`` retry
    abandoned, whose updates are in the weights HF goes on with. Whole rows only (a torn last
    one is left out); in JSON lines, the lines without a step (events) after the first record past
    ``step`` go with the records. ``path`` itself is not changed: its writer cuts it.
    ``(copy, rows)``, or ``None`` when there are none.

    A copy that cannot be made whole leaves nothing behind, the rows in ``path`` alone: one whose
    write failed after its rename (its folder not synced), or that a stop signal cut short, is
    removed again. A failure is one :class:`InputError` line naming the copy and saying nothing
    was moved (a full disk stays :class:`DiskFull`, its line saying so; a stop signal goes on as
    it came); a copy that could not be removed either is named as holding the rows too.

    Example::

        >>> import tempfile
        >>> csv = Path(tempfile.mkdtemp()) / "steps.csv"
        >>> _ = csv.write_text("step,lr\\n1,0.1\\n2,0.1\\n3,0.1", encoding="utf-8")  # (a torn row 3)
        >>> copy, rows = set_aside(csv, 0, header=True)
        >>> copy.name, rows, copy.read_text(encoding="utf-8")
        ('steps.attempt-1.csv', 2, 'step,lr\\n1,0.1\\n2,0.1\\n')
        >>> set_aside(csv, 2, header=True) is None
        True
        >>> set_aside(csv, 1, header=True)[0].name  # (attempt 1's is there: kept)
        'steps.attempt-2.csv'
        >>> log = csv.with_name("steps.jsonl")
        >>> _ = log.write_text('{"step": 1}\\n{"step": 2}\\n', encoding="utf-8")
        >>> set_aside(log, 1, header=False)[0].read_text(encoding="utf-8")
        '{"step": 2}\\n'
    """
    lines = path.read_bytes().splitlines(keepends=True) if path.is_file() else []
    head, rows = (lines[:1], lines[1:]) if header else ([], lines)
    after = [row for row in rows[_first_after(rows, step, header=header):] if row.endswith(b"\n")]
    records = sum(_step_of(row, header) is not None for row in after)  # (JSON lines: events move with them)
    if not records:
        return None
    attempt = 1
    while os.path.lexists(copy := path.with_name(f"{path.stem}.attempt-{attempt}{path.suffix}")):  # (a link too)
        attempt += 1
    try:
        replace_atomically(copy, b"".join([*head, *after]))
    except BaseException as err:
        _no_copy_left(err, path, copy, step)
        raise
    return copy, records


def _no_copy_left(err: BaseException, path: Path, copy: Path, step: int) -> None:
    """:func:`set_aside`'s copy that failed (``err``): removed if it was made all the same (the
    name was free: what is there is this copy), and ``err`` raised as one line that says so."""
    left = False
    if os.path.lexists(copy):  # (renamed, its folder not synced: replaced; or a signal after the rename)
        try:
            copy.unlink()
        except OSError:
            left = True
    if not isinstance(err, Exception):  # (a stop signal: it stays one)
        if left:
            with contextlib.suppress(Exception):
                err.add_note(f"ampguard: {copy} holds a copy of {shown(path)}'s rows after step {step} (remove it: "
                             "the file was not changed)")
        return
    what = f"cannot set {shown(path)}'s rows after step {step} aside in {copy.name}"
    if isinstance(err, DiskFull):
        why = f"disk full: {failed_because(err.error)}"
    elif isinstance(err, OSError):
        why = failed_because(err)
    else:
        why = first_line(err)
    if getattr(err, "replaced", False):
        why = f"its folder could not be synced after it was written ({why})"
    tail = (f"{copy.name} holds a copy of them all the same (remove it: {shown(path)} was not changed)" if left
            else "nothing was moved")
    line = f"{what}: {why}; {tail}"
    if isinstance(err, DiskFull):  # (a DiskFull still: callers tell a full disk by its class)
        err.args = (line,)
        return
    raise InputError(line) from None


def _step_of(line: bytes, header: bool) -> int | None:
    """The step of a line of a CSV (``header``) or of JSON lines; None for one that has none."""
    return _csv_step(line) if header else _record_step(line)


def _first_after(lines: Sequence[bytes], step: int, *, header: bool) -> int:
    """The index of the first whole line in ``lines`` whose step is after ``step``; ``len(lines)``
    when there is none."""
    return next((i for i, line in enumerate(lines) if line.endswith(b"\n") and (_step_of(line, header) or 0) > step),
                len(lines))


def require(package: str, flag: str) -> None:
    """Raise :class:`InputError` (one line, naming the extra) unless ``package`` can be imported.

    Example::

        >>> require("json", "log.json")
        >>> require("no_such_package_here", "log.wandb")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: log.wandb is on but the no_such_package_here package is not installed: pip install 'ampguard[no_such_package_here]'
    """
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent that is not a package, a module without a spec
        found = False
    if not found:
        raise InputError(f"{flag} is on but the {package} package is not installed: pip install 'ampguard[{package}]'")


def metric_number(value: object) -> float | None:
    """An extra value as a tracker's (and TensorBoard's) number: an int or a float, a numpy number, a one-element
    tensor (read from the device: a host sync), as the CSV writes them (an integer an ``int``,
    exact, :func:`~ampguard.records.format_value`); ``None`` for anything else (text, a bool, a
    missing value), which the CSV may hold and a tracker's metrics cannot.

    Example::

        >>> import numpy as np, torch
        >>> [metric_number(v) for v in (2, np.float32(0.5), torch.tensor([0.25]), np.int64(3), True, "warm-up", None)]
        [2, 0.5, 0.25, 3, None, None, None]
    """
    import torch

    if isinstance(value, torch.Tensor):  # (item(): an int tensor's int, a float tensor's float)
        return value.item() if value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool else None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # (numpy's integers too)
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # (numpy's bool is no Real)
        return float(value)
    return None


def _quiet_writer_thread(args: Any, *, before: Callable[[Any], None]) -> None:
    """``threading.excepthook`` from the first :class:`TensorBoardSink` on (once a process, kept:
    several sinks may be open at once): TensorBoard's writer thread re-raises its write's error
    after keeping it for the next call, where the sink raises it as the run's :class:`DiskFull`
    (one line); its traceback on stderr is not printed too. That holds for a writer of yours made
    later too, whose next call raises the error as well. Any other thread's error, and any other
    error, goes to the hook ``before``."""
    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    if not (isinstance(args.thread, _AsyncWriterThread) and disk_full_error(args.exc_value) is not None):
        before(args)


class TensorBoardSink:
    """Scalars for TensorBoard (``torch.utils.tensorboard``); needs the ``tensorboard`` package.

    Example (without ``tensorboard`` installed, the constructor says so in one line)::

        >>> import tempfile
        >>> from ampguard.records import StepLog
        >>> tmp = tempfile.TemporaryDirectory()
        >>> try:
        ...     sink = TensorBoardSink(tmp.name)
        ... except InputError as err:
        ...     ok = "tensorboard package is not installed" in str(err)
        ... else:
        ...     sink.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
        ...                        scaler_scale=1.0))
        ...     sink.close()
        ...     ok = any(name.startswith("events.out.tfevents") for name in os.listdir(tmp.name))
        >>> ok
        True
        >>> tmp.cleanup()
    """

    def __init__(self, log_dir: str | os.PathLike, *, keep_through: int | None = None) -> None:
        """``keep_through`` (a resume): the steps after it that an earlier writer left in
        ``log_dir`` are purged, so TensorBoard shows the resumed run's steps only. The new event
        file starts with a restart marker at ``keep_through + 1`` (``SummaryWriter``'s
        ``purge_step``); a reader drops the earlier events from that step on."""
        self.require()
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if keep_through is None else keep_through + 1
        if not isinstance(threading.excepthook, functools.partial) or \
                threading.excepthook.func is not _quiet_writer_thread:  # (once a process)
            threading.excepthook = functools.partial(_quiet_writer_thread, before=threading.excepthook)
        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)
        self._where = str(log_dir)
        self._last = 0  # the highest step written
        self._closed = False

    @classmethod
    def purge_after(cls, log_dir: Path, step: int) -> None:
        """The steps after ``step`` an earlier writer left in ``log_dir`` purged without writing
        more (a resume with ``log.tensorboard`` turned off: they are the abandoned timeline's):
        an event file of only the restart marker, as :meth:`__init__` writes one first."""
        cls(log_dir, keep_through=step).close()

    @staticmethod
    def require() -> None:
        """Raise :class:`InputError` unless the ``tensorboard`` package can be imported.

        Example::

            >>> import importlib.util
            >>> try:
            ...     TensorBoardSink.require()
            ...     found = True
            ... except InputError:
            ...     found = False
            >>> found == (importlib.util.find_spec("tensorboard") is not None)
            True
        """
        require("tensorboard", "log.tensorboard")

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        """The record's values and the extras that are numbers (text, a bool, a missing value
        left out, as the trackers leave them), each as a scalar at the record's step; a step at or
        before the last written, or a write after :meth:`close`, is refused as the CSV refuses
        it. TensorBoard keeps float32 (1e308 reads inf there; the CSV keeps every digit)."""
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if self._closed:
            raise ValueError(f"TensorBoardSink ({self._where}) is closed: nothing more can be written to it")
        check_step_after(f"TensorBoardSink ({self._where})", record.step, self._last or None,
                         "each step must come after the last one written (a second loop? give it a sink of its own)")
        refuse_record_fields(f"TensorBoardSink ({self._where})", extra)
        scalars = {name: value for name, value in record.values().items() if value is not None}
        scalars |= {name: number for name, value in (extra or {}).items() if (number := metric_number(value)) is not None}
        # (TensorBoard writes from a thread of its own and raises its error at the next call: a full
        # disk is the run's DiskFull, as the CSV's; review 52d: a raw OSError crashed the run, and
        # again at close, with no run card)
        with writing(self._where):
            for name, value in scalars.items():
                self._writer.add_scalar(f"train/{name}", value, record.step)
            self._writer.add_scalar("train/skipped", float(record.skipped), record.step)
        self._last = record.step

    def begin_again(self, step: int) -> str | None:
        """The loop began again from ``step`` (a Hugging Face ``auto_find_batch_size`` retry): a
        restart marker at ``step + 1``, as a resume's (``purge_step``), so TensorBoard drops the
        abandoned attempt's steps after ``step``. A line that says so, or ``None`` when none was written."""
        if self._last <= step:
            return None
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        with writing(self._where):
            self._writer._get_file_writer().add_event(
                Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))
            self._writer.flush()
        dropped, self._last = steps_from(step + 1, self._last), step
        return f"TensorBoard drops the abandoned attempt's {dropped} (a restart marker at step {step + 1})"

    def close(self) -> None:
        self._closed = True
        with writing(self._where):
            self._writer.close()


class BackgroundSink:
    """Writes records to ``inner`` from a background thread, in order.

    ``write`` starts the record's device-to-host copy (non-blocking, into pinned memory on
    CUDA) and queues it; the thread waits for that copy, not the training loop, then hands the
    record to ``inner``. ``close`` drains the queue (also after Ctrl-C: the loop's ``finally``
    closes its sinks), so every row written so far reaches the file. A sink nobody closed that
    nothing refers to any more (a notebook cell that made one, run again) is collected: its
    thread writes what is queued, closes ``inner`` and ends (an error left is one line on
    stderr); at the interpreter's exit so does one still referred to (a loop that crashed). The
    exit waits for those threads, :data:`DRAIN_AT_EXIT_S` at most for all of them (a stalled
    inner sink, or a Ctrl-C in the wait: one line a sink, with the records it loses); your own
    ``close()`` waits as long as it takes. An error in the thread is raised by
    the next ``write`` or by ``close``, and no record after the one that failed is written (a CSV
    never has a hole): every later ``write`` is refused, naming it. A write after ``close`` is
    refused too. A SIGKILL loses the records still queued (at most ``max_pending``; a
    ``CsvSink`` inside keeps whole rows, the steps up to some step): ``train`` writes its rows on
    the loop's thread instead. ``with BackgroundSink(...) as sink:`` closes it.

    Example::

        >>> from ampguard.records import StepLog
        >>> lines = []
        >>> sink = BackgroundSink(ConsoleSink(print_fn=lines.append))
        >>> for step in range(1, 4):
        ...     sink.write(StepLog(step, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0,
        ...                        scaler_scale=1.0))
        >>> sink.close()  # drains the queue: every record reaches the inner sink, in order
        >>> [line.split()[1] for line in lines]
        ['1', '2', '3']
    """

    _DONE = object()

    def __init__(self, inner: Sink, max_pending: int = 1024) -> None:
        import queue

        self.inner = inner
        # (what the thread holds, never the sink itself: a sink nobody closed is collected, and
        # its finalizer has the thread write what is queued, close ``inner`` and end; review 55r:
        # each re-run of a notebook cell left a thread and an open file until the kernel ended)
        self._writing = _Writing(inner, queue.SimpleQueue(), threading.Semaphore(max_pending) if max_pending > 0 else None)
        self._closed = False
        self._thread = threading.Thread(target=_write_in_background, args=(self._writing,), name="ampguard-writer",
                                        daemon=True)
        self._thread.start()
        # (a daemon thread: a loop that ends without close() does not hang at exit; its queue is
        # drained there instead, before the interpreter stops the thread)
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        # (SimpleQueue.put is reentrant: safe from a finalizer whatever the thread that collects the sink holds)
        self._finalizer = weakref.finalize(self, _dropped_unclosed, self._writing, self._thread, self._at_exit)
        self._finalizer.atexit = False  # (at exit, _close_at_exit has the thread drain and close; it waits, bounded)

    @property
    def _error(self) -> BaseException | None:
        """The thread's error, not raised yet."""
        return self._writing.error

    @property
    def _failed(self) -> BaseException | None:
        """The thread's error: nothing more is written."""
        return self._writing.failed

    def __enter__(self) -> BackgroundSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _raise(self) -> None:
        if self._writing.error is not None:
            err, self._writing.error = self._writing.error, None
            raise err

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        """Start the record's host copy and queue it; raises an earlier error of the thread, and
        what an inner :class:`CsvSink` refuses whatever the rows before (:meth:`CsvSink.check`:
        an undeclared column) before queuing. Waits while ``max_pending`` records are queued."""
        if record is None:
            raise TypeError(NONE_WRITTEN)
        if self._closed:
            raise ValueError("BackgroundSink is closed: nothing more can be written to it")
        self._raise()
        if self._failed is not None:  # (raised once already: the rows after it would leave a hole)
            raise ValueError(f"BackgroundSink: its writer failed ({first_line(self._failed)}): nothing more "
                             "is written to it")
        if isinstance(self.inner, CsvSink):
            self.inner.check(record, extra)
        wait = record.prefetch()  # (first: one that raises, a Ctrl-C in the copy's set-up, holds no room)
        if self._writing.room is not None:
            self._writing.room.acquire()
        self._writing.queued += 1
        self._writing.queue.put((record, extra, wait))

    def begin_again(self, step: int) -> str | None:
        """The loop began again from ``step`` (a Hugging Face ``auto_find_batch_size`` retry): the
        records queued so far reach ``inner`` first, then ``inner.begin_again(step)`` sets the
        abandoned attempt's aside (``None`` when ``inner`` has no ``begin_again``). Raises an
        error of the thread, as ``write`` does."""
        if self._thread.is_alive():
            written = threading.Event()
            self._writing.queue.put(written.set)
            written.wait()
        self._raise()
        again = getattr(self.inner, "begin_again", None)
        return again(step) if again is not None else None

    def close(self) -> None:
        """Drain the queue, stop the thread, close ``inner``; raises an error of the thread. A
        second ``close`` does nothing."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        atexit.unregister(self._at_exit)
        if self._thread.is_alive():
            self._writing.queue.put(self._DONE)
            self._thread.join()
        self.inner.close()
        self._raise()


_DROPPED = object()
"""Put on a :class:`BackgroundSink`'s queue when the sink was collected unclosed: the thread writes
what is queued before it, closes the inner sink and ends."""


class _Writing:
    """A :class:`BackgroundSink`'s writer thread's state: the inner sink, the queue, the room left
    in it (``max_pending``; None: no bound), the error not raised yet and the one that stopped the
    writing, the records queued and those the inner sink took (what an exit that could not wait
    says lost). The thread holds this, not the sink."""

    __slots__ = ("inner", "queue", "room", "error", "failed", "queued", "written")

    def __init__(self, inner: Sink, queue: Any, room: threading.Semaphore | None) -> None:
        self.inner, self.queue, self.room = inner, queue, room
        self.error: BaseException | None = None
        self.failed: BaseException | None = None
        self.queued = self.written = 0  # (each counted by one thread only: the writer's caller, the writer)


def _write_in_background(writing: _Writing) -> None:
    """The writer thread: each record queued, in order, to the inner sink; none after one failed
    (a CSV never has a hole). Ends at ``close()``'s mark, or at a dropped sink's (:data:`_DROPPED`),
    after which it closes the inner sink itself and says an error nobody was left to raise."""
    while True:
        item = writing.queue.get()
        if item is BackgroundSink._DONE:
            return
        if item is _DROPPED:
            try:
                writing.inner.close()
            except BaseException as err:  # noqa: BLE001 - nobody to raise it to: said
                writing.error = writing.error or err
            try:
                if writing.error is not None:
                    print(f"ampguard: a BackgroundSink nobody closed could not write all its records: "
                          f"{first_line(writing.error)}", file=sys.stderr)
            finally:  # (in _DRAINING means still at work: the exit says it lost what it had not written)
                _DRAINING.pop(threading.current_thread(), None)  # (all written: the exit need not wait for it)
            return
        if callable(item):  # a barrier (begin_again): every record queued before it is written
            item()
            continue
        record, extra, wait = item
        try:
            if writing.failed is None:
                wait()
                writing.inner.write(record, extra)
                writing.written += 1
        except BaseException as err:  # noqa: BLE001 - handed to the writer's caller
            writing.error = writing.failed = err
        finally:
            if writing.room is not None:
                writing.room.release()


DRAIN_AT_EXIT_S = 30.0
"""How long the interpreter's exit waits, all together, for the writer threads of the background
sinks nobody closed (dropped unclosed, or still referred to at exit: a loop that crashed, whose
uncaught exception's traceback keeps it, a module's global) that are still writing what was
queued (an inner sink that stalled, a hung network disk, must not hang the exit for good: what
is left is said lost, one line a sink). A ``close()`` of yours waits for its thread unbounded."""

_DRAINING: dict[threading.Thread, _Writing] = {}
"""The writer threads of sinks nobody closed that have not written all they were given yet (each
takes itself out once it has): daemon threads, which the exit would stop mid-queue (a loop that
crashed and whose caller returned at once lost up to ``max_pending`` rows: review 56a), so
:func:`_join_draining` waits for them. Only while they write: a notebook keeps nothing of them."""

_exit_wait_left: float | None = None
"""How long the exit may still wait for writer threads, all its waits together: :data:`DRAIN_AT_EXIT_S`
at its first (one bound for every sink: review 56l, a sink still referred to at exit was joined
with none; the time other exit hooks take in between is not counted), ``0`` once a Ctrl-C cut a
wait (:data:`_exit_cut`); ``None`` outside the exit."""
_exit_cut = False


def _dropped_unclosed(writing: _Writing, thread: threading.Thread, at_exit: Callable[[], None]) -> None:
    """A :class:`BackgroundSink` collected unclosed (a notebook cell run again, a loop that crashed),
    or still referred to at exit (:func:`_close_at_exit`): its thread writes what is queued, closes
    the inner sink and ends; the exit waits for it (:func:`_join_draining`, within
    :data:`DRAIN_AT_EXIT_S`) instead of closing the sink."""
    if thread.is_alive():  # (before the mark: the thread takes itself out once it has passed it)
        _DRAINING[thread] = writing
    writing.queue.put(_DROPPED)
    atexit.unregister(at_exit)


def _wait_at_exit(threads: Iterable[threading.Thread]) -> None:
    """At exit, wait for the writer ``threads`` within the exit's one bound (:data:`_exit_wait_left`).
    A Ctrl-C ends the wait, and every wait after it: each sink still writing is then said by
    :func:`_join_draining`, not a traceback (review 56l)."""
    global _exit_wait_left, _exit_cut
    if _exit_wait_left is None:
        _exit_wait_left = DRAIN_AT_EXIT_S
    for thread in threads:
        began = time.monotonic()
        try:
            thread.join(timeout=max(0.0, _exit_wait_left))
        except KeyboardInterrupt:
            _exit_wait_left, _exit_cut = 0.0, True
            return
        _exit_wait_left -= time.monotonic() - began


def _lost_at_exit(writing: _Writing) -> str:
    """The line for a sink whose writer thread had not ended when the exit stopped waiting: what
    it loses, or, every record written, that its inner sink's ``close()`` stalled."""
    inner = writing.inner
    named = type(inner).__name__ + (f" {shown(inner.path)}" if isinstance(getattr(inner, "path", None), Path) else "")
    when = "when a Ctrl-C cut the exit's wait" if _exit_cut else f"at exit after {DRAIN_AT_EXIT_S:g} s"
    if writing.queued == writing.written:  # (an fsync on a hung disk: nothing is lost that a line could count)
        return (f"ampguard: a BackgroundSink nobody closed was still closing its {named} {when} (every record "
                f"written{'' if _exit_cut else '; its close() stalled: a hung disk?'})")
    if _exit_cut:
        return (f"ampguard: a BackgroundSink nobody closed was still writing to its {named} {when}: it loses its "
                f"last {counted(writing.queued - writing.written, 'record')}")
    return (f"ampguard: a BackgroundSink nobody closed was still writing {when} (its {named} stalled: a hung "
            f"disk?): it loses its last {counted(writing.queued - writing.written, 'record')}")


@atexit.register  # (at import: run after every sink's own at-exit close, registered later)
def _join_draining() -> None:
    """At the interpreter's exit, the threads of sinks nobody closed write what they were given
    (:data:`_DRAINING`), for :data:`DRAIN_AT_EXIT_S` at most all together; a sink whose thread is
    still writing then (or when a Ctrl-C cut the wait) is said, once, with the records it loses."""
    global _exit_wait_left, _exit_cut
    _wait_at_exit(list(_DRAINING))
    # (still in _DRAINING: still at work, each takes itself out as it ends; not is_alive(), which a join a Ctrl-C
    # cut leaves False for a thread still running, its lock released by the interrupted join)
    for thread in list(_DRAINING):
        if (state := _DRAINING.pop(thread, None)) is not None:
            print(_lost_at_exit(state), file=sys.stderr)
    _exit_wait_left, _exit_cut = None, False  # (the exit's last: nothing waits after it)


def _close_at_exit(ref: weakref.ReferenceType[BackgroundSink]) -> None:
    """At the interpreter's exit, a :class:`BackgroundSink` nobody closed that is still referred to
    (a loop that crashed, whose uncaught exception's traceback keeps it; a module's global) writes
    what is queued and closes its inner sink from its thread, as a dropped one does, and the exit
    waits for it here (what it runs next, a tracker's own end, finds it closed), within the exit's
    one bound: its ``close()`` joined a stalled thread with none, a hung exit (review 56l). An error
    is one line."""
    sink = ref()
    if sink is None:
        return
    thread = sink._thread
    if not thread.is_alive():  # (a forked child: the thread stayed in the parent; nothing to wait for)
        try:
            sink.close()
        except BaseException as err:  # noqa: BLE001 - at exit: said, nothing to raise to
            print(f"ampguard: BackgroundSink could not write its last records at exit: {first_line(err)}",
                  file=sys.stderr)
        return
    sink._closed = True
    sink._finalizer()  # (_dropped_unclosed, once: the thread writes the queue, closes inner, says an error)
    del sink
    _wait_at_exit([thread])


def newly_lost(sinks: Sequence[Any], told: list[Any]) -> list[str]:
    """Why each tracker sink of ``sinks`` lost since ``told`` was last extended (here) stopped
    taking steps (its ``lost``: its store or server failed; the run goes on without it): each
    loss once, for a run's event log (``tracker_lost``).

    Example::

        >>> class Lost:
        ...     lost = "MLflow run r stopped taking steps at step 3 (the store is full)"
        >>> told, sinks = [], [Lost(), object()]
        >>> newly_lost(sinks, told), newly_lost(sinks, told)
        (['MLflow run r stopped taking steps at step 3 (the store is full)'], [])
    """
    lost = [sink for sink in sinks if getattr(sink, "lost", None) and sink not in told]
    told.extend(lost)
    return [sink.lost for sink in lost]


def _on_each(sinks: Sequence[Any], call: Callable[[Any], None]) -> None:
    """``call(sink)`` for every one of ``sinks``, the first error raised once all were called (a
    sink failing does not leave the ones after it unclosed or their tracker runs unended)."""
    errors = []
    for sink in sinks:
        try:
            call(sink)
        except Exception as err:  # noqa: BLE001 - raised below, once the others were called
            errors.append(err)
    if errors:
        raise errors[0]


class Sinks:
    """Several sinks as one.

    Example::

        >>> from ampguard.records import StepLog
        >>> a, b = [], []
        >>> both = Sinks(ConsoleSink(print_fn=a.append), ConsoleSink(print_fn=b.append))
        >>> both.write(StepLog(1, lr=0.1, loss=0.5, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, scaler_scale=1.0))
        >>> both.close()
        >>> a == b == ["STEP 1 loss=0.5 pre=2 post=1 scale=1 lr=0.1"]
        True
    """

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = list(sinks)
        self.failed: DiskFull | None = None
        """The first write that found the disk full. That sink is dropped; the others go on (the
        run stops at the step's end: ``Trainer``)."""
        self._told: list[Any] = []  # the lost tracker sinks newly_lost() named

    def write(self, record: StepRecord, extra: Mapping[str, ExtraValue] | None = None) -> None:
        for sink in list(self.sinks):  # (each refuses a None itself: NONE_WRITTEN)
            try:
                sink.write(record, extra)
            except DiskFull as full:
                self._drop(sink, full, through=record.step - 1)

    def sync(self) -> None:
        """Every line written so far made durable, in the sinks that write files (:meth:`_LineFile.sync`)."""
        for sink in list(self.sinks):
            if hasattr(sink, "sync"):
                try:
                    sink.sync()
                except DiskFull as full:
                    self._drop(sink, full, through=None)

    def observe(self, monitor: Any, events: Sequence[Any] = ()) -> None:
        """The run monitor's view of the step just written (and the events it raised), to the
        sinks that take it (the tracker sinks, ``ampguard.integrations.trackers``)."""
        for sink in self.sinks:
            if hasattr(sink, "observe"):
                sink.observe(monitor, events)

    def close(self) -> None:
        """Every sink closed, the first error other than a full disk raised after the others
        closed (review 52d: a sink failing stopped the loop, the tracker runs after it left open)."""
        def close(sink: Sink) -> None:
            try:
                sink.close()
            except DiskFull as full:
                self._drop(sink, full, through=None)

        _on_each(list(self.sinks), close)

    def finish(self, result: Any) -> None:
        """After the run card is written: the sinks that end a tracker run (``finish(result)``)
        upload the run folder's files and end it; every one of them, the first error raised after
        (one that failed left the next one's run FAILED, with no totals: review 50f)."""
        _on_each([sink for sink in self.sinks if hasattr(sink, "finish")], lambda sink: sink.finish(result))

    def newly_lost(self) -> list[str]:
        """:func:`newly_lost` of these sinks, for the run's event log."""
        return newly_lost(self.sinks, self._told)

    def _drop(self, sink: Sink, full: DiskFull, through: int | None) -> None:
        if sink in self.sinks:
            self.sinks.remove(sink)
            with contextlib.suppress(Exception):  # its buffer found no room: nothing more to save
                sink.close()
        if self.failed is None:
            full.through = through
            self.failed = full
