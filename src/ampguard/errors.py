"""What can go wrong, and how the process says so: bad-input errors and the exit codes.

The exit codes are a contract (``docs/design.md``, "Exit codes"): every verb returns one of
these, and :func:`ampguard.cli.main` maps exceptions onto them in one place.

Example::

    >>> int(ExitCode.GUARD), ExitCode(2).name
    (3, 'BAD_INPUT')
"""

import contextlib
import errno
import os
import re
import stat
import sys
import tempfile
import unicodedata
import warnings
from collections.abc import Callable, Iterator, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple


MAX_COUNT = 10**9
"""The largest count a setting or flag takes (steps, batch sizes, intervals, rounds): past it a
run would never end or its tables would not fit in memory (the fast path's LR table has
``steps + 1`` float32 entries on the device, 4 GB here, built by chunks with bounded host memory:
``schedule.factor_table``). Here, with no import, so that the command line checks its flags without
importing torch."""
MAX_WINDOW = 10**7
"""The largest rolling window (``monitor.window``, ``rollback.window``, ``report --window``): each
keeps a ring of that many numbers in memory."""
DEFAULT_MIN_STEPS = 100
"""Steps a :class:`~ampguard.monitor.RunMonitor` sees before its skip-rate ALERT is armed
(``monitor.min_steps``; ``ampguard.monitor.DEFAULT_MIN_STEPS`` too). Here, as ``MAX_WINDOW``, so that
the config is validated without importing torch.

The fp16 scaler's search down from ``init_scale`` skips a handful of opening steps; over the
first n steps k such skips read as a rate of k/n. At the default ``alert_rate`` 0.05, 100 steps
dilute up to 5 of them to 5%, which is not above the threshold (20 would let 2 of them alert).
"""


def real_number(value: object) -> bool:
    """Whether ``value`` is an int or a float, not a bool (Python's ``True`` is an int): what a
    number read from a file or handed to the library is checked with before its value is.

    Example::

        >>> [real_number(v) for v in (1, 2.5, float("nan"), True, "1", None)]
        [True, True, True, False, False, False]
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def whole_number(value: object, least: int = 0) -> bool:
    """Whether ``value`` is an int (not a bool) of at least ``least``: what a count handed to the
    library is checked with (a config's counts are pydantic's).

    Example::

        >>> [whole_number(v, 1) for v in (1, 2, 0, 1.5, 2.0, True, "2", None)]
        [True, True, False, False, False, False, False, False]
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def counted(n: int, noun: str, plural: str = "") -> str:
    """``n`` and its noun, in the plural unless there is one: what every "N steps" a person reads
    is written with.

    Example::

        >>> counted(1, "step"), counted(0, "step"), counted(2, "micro-batch", "micro-batches")
        ('1 step', '0 steps', '2 micro-batches')
    """
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def listed(names: Sequence[str], first: int = 3, joint: str = ", ", more: str = ", ...") -> str:
    """The ``first`` of ``names`` joined by ``joint``, then ``more`` when there are others: how a
    line names a few of many (modules, layers, parameters) and says there are more.

    Example::

        >>> listed(["a", "b"]), listed(["a", "b", "c", "d"]), listed("abc", 2, " and ", " and others")
        ('a, b', 'a, b, c, ...', 'a and b and others')
    """
    return joint.join(names[:first]) + (more if len(names) > first else "")


def shortened(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters for an error line: its head and its tail around
    ``...`` when it is longer (a long path keeps its file name, a long message its end).

    Example::

        >>> shortened("'/tmp/a-very-long-folder-name/and-another/run.py'", 40)
        "'/tmp/a-very-long-folder-...ther/run.py'"
        >>> shortened("short", 40), len(shortened("x" * 999, 200)), shortened("abcdef", 3)
        ('short', 200, 'abc')
    """
    if len(text) <= limit:
        return text
    if limit <= 3:  # (no room for a head, a tail and the dots)
        return text[:max(limit, 0)]
    tail = (limit - 3) // 3
    return text[:limit - 3 - tail] + "..." + text[len(text) - tail:]


def brief(value: object) -> str:
    """A value from a file (a checkpoint's, a saved state's) for an error line: a short repr of
    a plain value, else its kind.

    Example::

        >>> brief("x"), brief([0.0, 1.0]), brief(object())
        ("'x'", 'a list of 2', 'a object')
    """
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    if not isinstance(value, (str, int, float, type(None))):
        return f"a {type(value).__name__}"
    return shortened(repr(value), 40)


class ExitCode(IntEnum):
    """How an ``ampguard`` process ends."""

    OK = 0
    """Done: the run finished, the validation accepted, locate found everything finite."""
    REJECTED = 1
    """``validate`` rejected the precision; ``locate`` found a non-finite value."""
    CRASHED = 1
    """The task's own code (or a bug) raised mid-run: the run card says so, then the traceback,
    whose exit status Python makes 1 (an alias of ``REJECTED``'s number, named for what happened)."""
    BAD_INPUT = 2
    """Usage, config, data or checkpoint could not be used: one line on stderr, nothing written."""
    GUARD = 3
    """A guard stopped the run (skip rate, scale collapse, strict mode, rollbacks used up)."""
    DISK_FULL = 74
    """A run's file could not be written: no space left, the quota or the file-size limit
    (``ulimit -f``) reached. One line names the file and the step up to which the run is intact;
    nothing more is written. 74 is ``EX_IOERR`` of BSD's ``sysexits.h``."""
    INTERRUPTED = 130
    """Ctrl-C: logs flushed, a checkpoint and the run card written where possible."""
    BROKEN_PIPE = 141
    """stdout's reader left (``ampguard train | head``): a run stops as on SIGTERM, checkpoint
    and run card written; 128 + 13, the SIGPIPE that ends a Unix tool there."""
    TERMINATED = 143
    """SIGTERM (a scheduler's stop): handled as Ctrl-C is, exit 128 + 15 as shells report it."""


class InputError(Exception):
    """Bad input from the user (usage, config, data file, checkpoint). One line, names the problem.

    Example::

        >>> try:
        ...     raise InputError("data.csv: no such file")
        ... except InputError as err:
        ...     print(f"error: {err}")
        error: data.csv: no such file

    ``key``, when given, is the config key the input was read from, for a caller that adds to
    what the error says about it (never its text: ``err.key == "task.batch_size"``).
    """

    def __init__(self, *args: object, key: str | None = None) -> None:
        super().__init__(*args)
        self.key = key


class AmpguardWarning(UserWarning):
    """Something worth one line before a run goes on, ``ampguard: warning: ...`` on stderr
    (``ampguard.cli`` shows it so; in a program of yours, a Python warning). One about the run as
    a whole (its config, the settings given, the loop's code: the same on every rank) is said
    once under torchrun, by rank 0 (:func:`warn`)."""


class RankWarning(AmpguardWarning):
    """An :class:`AmpguardWarning` about this process's own state, which another rank's may not
    share (the data its factory built, the model's mode, its evaluation, an error it met, the
    sinks it was given): under torchrun each rank that sees it says it, beginning ``rank N: ``
    (:func:`warn`)."""


LAUNCH_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun sets beside ``WORLD_SIZE`` (what the env:// rendezvous reads): a launch has
them all (:func:`process_rank`; :func:`ampguard.launch.launched_by_torchrun` refuses a
``WORLD_SIZE`` > 1 without one)."""


def process_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process: the process group's once one is joined (torchrun's
    or a launcher's own), else torchrun's ``RANK`` and ``WORLD_SIZE`` (set before any group is)
    where torchrun set the variables it sets beside them (``MASTER_ADDR``, ``MASTER_PORT``: a
    ``RANK`` and ``WORLD_SIZE`` left in the environment alone, or values that do not read as a
    rank of that world, are no launch; review 51k); ``(0, 1)`` in a world of one. The one place
    ampguard learns the rank from the environment (its warnings, :func:`warn`; the CLI's verbs
    that run on rank 0 alone); torch is not imported for it.

    Example::

        >>> import unittest.mock
        >>> torchrun = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        >>> with unittest.mock.patch.dict(os.environ, torchrun):
        ...     process_rank()
        (1, 2)
        >>> with unittest.mock.patch.dict(os.environ, {**torchrun, "WORLD_SIZE": "1", "RANK": "3"}):
        ...     process_rank()
        (0, 1)
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "1"}):  # (a leftover pair)
        ...     for name in ("MASTER_ADDR", "MASTER_PORT"):
        ...         _ = os.environ.pop(name, None)
        ...     process_rank()
        (0, 1)
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if not all(os.environ.get(name) for name in LAUNCH_VARIABLES):  # (torchrun's, beside WORLD_SIZE)
        return 0, 1
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:  # (torchrun's variables, spoilt: refused in one line where a run starts)
        return 0, 1
    return (rank, world) if world > 1 and 0 <= rank < world else (0, 1)


def said_here(message: str | Warning, category: type[Warning]) -> str | Warning | None:
    """``message`` as this process says it, or ``None`` where another says it. In a world of
    several: an :class:`AmpguardWarning` about the run as a whole on rank 0 alone (every rank
    would say the same line: rank 1's copy doubled the console), a :class:`RankWarning` on the
    rank that sees it, beginning ``rank N: ``; any other warning as it is.

    Example::

        >>> import unittest.mock
        >>> torchrun = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
        >>> with unittest.mock.patch.dict(os.environ, torchrun):
        ...     said_here("steps 3 < warmup 5", AmpguardWarning), str(said_here("its data...", RankWarning))
        (None, 'rank 1: its data...')
    """
    if not issubclass(category, AmpguardWarning):
        return message
    rank, world = process_rank()
    if world == 1:
        return message
    if issubclass(category, RankWarning):
        return category(f"rank {rank}: {message}")
    return message if rank == 0 else None


def warn(message: str | Warning, category: type[Warning] = AmpguardWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)``, as ampguard says its warnings under torchrun
    (:func:`said_here`: a warning about the run as a whole by rank 0 alone, one about a rank's own
    state by that rank, labelled); outside torchrun, just that. A ``Warning`` given as ``message``
    is of its own category.

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("always")
        ...     warn("schedule.warmup 100 > steps 3")
        >>> [(str(w.message), w.category.__name__) for w in said]
        [('schedule.warmup 100 > steps 3', 'AmpguardWarning')]
    """
    if isinstance(message, Warning):
        category = type(message)
    said = said_here(message, category)
    if said is not None:
        warnings.warn(said, category, stacklevel + 1)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the function calling this, name
    the first frame outside ampguard: the user's line, whichever of ampguard's paths led there
    (``Guard(...)`` or ``AmpTrainState(...)``, ``guard.backward`` or ``state.step``: a fixed
    level named ampguard's own ``AmpTrainState.step`` for the shortcut, review 47e).

    Example (called from outside ampguard: the caller itself)::

        >>> user_stacklevel()
        1
    """
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE) and \
            (not frame.f_code.co_filename.startswith(_INTEGRATIONS)  # (an integration's line: ampguard's own
             or frame.f_code in _CALLED_BY_USER):                    # plugin, not the framework's, review 47f)
        frame, level = frame.f_back, level + 1
    return level


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTEGRATIONS = os.path.join(_PACKAGE, "integrations") + os.sep
_CALLED_BY_USER: set[Any] = set()
"""The code of the integrations' functions a user's own line calls (:func:`called_by_user`)."""


def called_by_user(function: Callable[..., Any]) -> Callable[..., Any]:
    """Mark an integration's function that the user's own line calls, not the framework
    (``make_guard``, ``AmpGuardPlugin(...)``): :func:`user_stacklevel` walks past it to that line
    (review 58f: a warning ``Guard(...)`` raised inside ``make_guard`` named ampguard's own line).
    A framework's callback (the plugin's hooks, ``GuardState.load_state_dict``) is not marked:
    its warnings name the integration's line, which says which plugin it was. The function
    itself is returned (nothing wraps it).

    Example::

        >>> def make_thing():
        ...     return "thing"
        >>> called_by_user(make_thing) is make_thing
        True
    """
    _CALLED_BY_USER.add(function.__code__)
    return function


def warn_each_time(message: str | Warning, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """``warnings.warn(message, category, stacklevel)``, shown at every call: Python's default
    action shows a (text, category, line) once a process (the module's ``__warningregistry__``),
    so a line about one run, the same text as an earlier run's (a Lightning fit's ALERT or stop,
    run again in a notebook cell or a sweep's trials), went unsaid (review 58f). Each call is
    judged with a registry of its own; the filters still apply (``ignore``, ``error``, ``once``).

    Example::

        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as said:
        ...     warnings.simplefilter("default")
        ...     for _ in range(2):
        ...         warn_each_time("ALERT at step 3")
        >>> [str(w.message) for w in said]
        ['ALERT at step 3', 'ALERT at step 3']
    """
    message = said_here(message, type(message) if isinstance(message, Warning) else category)
    if message is None:  # (under torchrun, rank 0's to say: :func:`warn`)
        return
    frame = sys._getframe(1)
    for _ in range(stacklevel - 1):  # (as warnings.warn's stacklevel: 1 is the line that calls this)
        if frame.f_back is None:
            break
        frame = frame.f_back
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=frame.f_globals.get("__name__", "<string>"), registry=None,
                           module_globals=frame.f_globals)


class ConfigError(InputError):
    """A config that cannot be used; the message names the key.

    Example (an ``InputError``, so the CLI reports it the same way)::

        >>> from ampguard.config import validate
        >>> try:
        ...     validate({"precision": "fp7"})
        ... except InputError as err:
        ...     print(isinstance(err, ConfigError), "precision" in str(err))
        True True
    """


def failed_because(err: BaseException) -> str:
    """Why an operation failed, for a one-line refusal that names the path itself: an ``OSError``'s
    ``strerror`` (no errno, no path), else the error's :func:`first_line`.

    Example::

        >>> failed_because(FileNotFoundError(2, "No such file or directory", "x.csv"))
        'No such file or directory'
        >>> failed_because(OSError("cut\\nshort")), failed_because(ValueError())
        ('cut', 'ValueError')
    """
    return err.strerror if isinstance(err, OSError) and err.strerror else first_line(err)


def first_line(err: BaseException, with_type: bool = False) -> str:
    """An error in one line for a one-line refusal: the first line of its message, with its type
    in front when ``with_type`` (the type alone for an empty message).

    Example::

        >>> first_line(ValueError("bad shape\\nat layer 3")), first_line(KeyError(), with_type=True)
        ('bad shape', 'KeyError')
        >>> first_line(RuntimeError("size mismatch"), with_type=True)
        'RuntimeError: size mismatch'
    """
    text = str(err).strip()
    if not text:
        return type(err).__name__
    return f"{type(err).__name__}: {text.splitlines()[0]}" if with_type else text.splitlines()[0]


def plain_digits(text: str) -> bool:
    """Whether ``text`` writes its number as the run's files and configs do: ASCII, no ``_``.
    Python's ``int`` and ``float`` also read other scripts' digits (``'٣'``, ``'１'``) and
    ``1_000``, which the config refuses.

    Example::

        >>> plain_digits("12.5"), plain_digits("1e-3"), plain_digits("\u0663"), plain_digits("1_000")
        (True, True, False, False)
    """
    return text.isascii() and "_" not in text


SHOWN_FORMAT = frozenset("\u00ad\u200c\u200d\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891"
                         "\u08e2\U000110bd\U000110cd\u180e" + "".join(map(chr, range(0x13430, 0x13440)))
                         + "".join(map(chr, range(0x1bca0, 0x1bca4))) + "".join(map(chr, range(0x1d173, 0x1d17b))))
"""The format characters (Unicode's Cf) a name may hold: the soft hyphen, the zero-width
non-joiner of Persian and the joiner of an emoji sequence, the number signs written before
Arabic, Syriac and Kaithi numbers, the Mongolian vowel separator, and the controls that shape
Egyptian hieroglyphs, Duployan shorthand and musical notation (each part of what is shown). Every other format character hides what the
text is and is refused: the zero-width space and no-break space (a folder ``a\u200bb`` shows as
``ab``), the word joiner and invisible operators, the bidirectional marks, embeddings, overrides
and isolates (``a\u202eb`` shows its end reversed), the tag characters (outside an emoji flag's
tag sequence, :data:`_EMOJI_TAGS`), the interlinear annotation marks."""
_EMOJI_TAGS = re.compile("\U0001f3f4[\U000e0061-\U000e007a]{2}[\U000e0061-\U000e007a\U000e0030-\U000e0039]{1,4}"
                         "\U000e007f")
"""An emoji flag's tag sequence: the black flag, a subdivision code in tag letters and digits
(``gbeng``: the flag of England), the cancel tag; any other tag text would hide a name."""


MAX_MESSAGE = 2000
"""The most characters a refusal's line shows (a 100 KB argument made a 100 KB line: review 50j)."""


def one_line(message: str) -> str:
    r"""A refusal's message as one line: each character :func:`has_control` names (a newline from
    a path or a value the user gave) as its escape, the whole cut to :data:`MAX_MESSAGE`
    characters (:func:`shortened`). The command line's last guard of "one line"; each refusal
    shows what it quotes with :func:`shown` first.

    Example::

        >>> one_line("config a\nb.yaml: not found"), len(one_line("x" * 10**5))
        ('config a\\nb.yaml: not found', 2000)
        >>> one_line("a\\nb\n.yaml")  # (a backslash the name holds, then a newline: told apart)
        'a\\\\nb\\n.yaml'
        >>> one_line("\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f\n") == "\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f\\n"
        True
    """
    if has_control(message):  # (a backslash doubled, as the escapes it then sits beside; an emoji flag's tags kept)
        parts, at = [], 0
        for flag in [*_EMOJI_TAGS.finditer(message), None]:
            end = flag.start() if flag is not None else len(message)
            parts.append("".join(c.encode("unicode_escape").decode("ascii") if has_control(c) or c == "\\" else c
                                 for c in message[at:end]))
            if flag is not None:
                parts.append(flag.group())
                at = flag.end()
        message = "".join(parts)
    return shortened(message, MAX_MESSAGE)


def has_control(text: str) -> bool:
    """Whether ``text`` holds a control character (Unicode's Cc: C0, DEL and C1, a NUL, a tab, a
    newline, NEL), a line or paragraph separator, or a format character that hides what the text
    is (a Cf outside :data:`SHOWN_FORMAT`): what would split a one-line message, a CSV header or a console line,
    reach the OS as a raw byte, or show one name as another.

    Example::

        >>> has_control("val_loss"), has_control("a\\0b"), has_control("a\\x85b"), has_control("a\\u2028b")
        (False, True, True, True)
        >>> has_control("a\\u00a0b")  # a no-break space is a space
        False
        >>> has_control("a\\u202eb"), has_control("a\\u200bb"), has_control("\\U0001f469\\u200d\\U0001f4bb")
        (True, True, False)
        >>> has_control("a\\u2060b"), has_control("a\\U000e0041b"), has_control("\\U0001f3f4\\U000e0067\\U000e0062\\U000e0065\\U000e006e\\U000e0067\\U000e007f")
        (True, True, False)
        >>> has_control("\\U0001f3f4\\U000e0053\\U000e0045\\U000e0043\\U000e007f"), has_control("\\u182c\\u1820\\u1837\\u180e\\u1820")
        (True, False)
    """
    if _EMOJI_TAGS.search(text):
        text = _EMOJI_TAGS.sub("", text)
    return any((category := unicodedata.category(c)) in ("Cc", "Zl", "Zp") or category == "Cf" and c not in SHOWN_FORMAT
               for c in text)


MAX_RAISED = 200
"""The most characters of what the user's code raised that a one-line refusal shows."""


def raised(err: BaseException) -> str:
    """What the user's code (a factory, its data, its ``evaluate``) raised, for a one-line
    refusal: its type and its message's first line (a ``load_state_dict`` error lists the keys on
    the lines below), cut to :data:`MAX_RAISED` characters. A ``SystemExit`` whose code is
    neither a message nor a number is named by the code's kind (``task.factory=sys:exit`` exits
    with the whole Config, whose repr is 1.5 KB).

    Example::

        >>> raised(RuntimeError("Error(s) in loading state_dict for Linear:\\n\\tMissing key(s)"))
        'RuntimeError: Error(s) in loading state_dict for Linear:'
        >>> raised(SystemExit(object())), raised(SystemExit(3)), raised(GeneratorExit())
        ('SystemExit: a object', 'SystemExit: 3', 'GeneratorExit')
        >>> len(raised(ValueError("x" * 999)))
        200
    """
    if isinstance(err, SystemExit) and not isinstance(err.code, (str, int, type(None))):
        return f"SystemExit: {brief(err.code)}"
    return shortened(visible(first_line(err, with_type=True)), MAX_RAISED)


def visible(text: str) -> str:
    r"""``text`` with each control character written as its escape (``\x1b``): what the user's
    code raised reaches the terminal as text, not as an escape sequence (a cleared screen, a bell).

    Example::

        >>> visible("bad\x1b[2J value\x07"), visible("plain: ok")
        ('bad\\x1b[2J value\\x07', 'plain: ok')
        >>> visible("\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f\x07") == "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f\\x07"
        True
    """
    if not has_control(text):  # (as a whole: an emoji tag sequence, a subdivision's flag, is shown as it is)
        return text
    shown, last = [], 0
    for tags in _EMOJI_TAGS.finditer(text):
        shown += [_escaped(text[last:tags.start()]), tags.group()]
        last = tags.end()
    return "".join([*shown, _escaped(text[last:])])


def _escaped(text: str) -> str:
    """Each character of ``text`` :func:`has_control` finds, written as its escape."""
    return "".join(c.encode("unicode_escape").decode("ascii") if has_control(c) else c for c in text)


def table_cell(value: object) -> str:
    r"""A value as one cell of a Markdown table (validate's report, compare's table): a ``|`` in it
    escaped, each control character written as its escape (:func:`visible`): a run named
    ``lr|3e-3`` made a column too many, one whose folder name held a newline split its row
    (review 53b).

    Example::

        >>> table_cell("scores: |a - b| <= 0.1"), table_cell("clip\nrun"), table_cell(0.5)
        ('scores: \\|a - b\\| <= 0.1', 'clip\\nrun', '0.5')
    """
    return visible(str(value)).replace("|", "\\|")


def an_interrupt(err: BaseException) -> bool:
    """A Ctrl-C, or one that an error raised on its way out carries: a KeyboardInterrupt raised
    while a class body runs (an import torch makes lazily, e.g. ``torch._dynamo`` from the
    optimizer's constructor) comes out as ``RuntimeError: Error calling __set_name__`` caused by
    it; one inside ``torch.save`` as the zip writer's own ``RuntimeError ... unexpected pos``
    raised while it unwound (its ``__context__``: a second Ctrl-C during a checkpoint's save read
    as a crash, exit 1, review 49f).

    Example::

        >>> wrapped = RuntimeError("Error calling __set_name__ on 'Field' instance")
        >>> wrapped.__cause__ = KeyboardInterrupt()
        >>> unwound = RuntimeError("[enforce fail at inline_container.cc] . unexpected pos")
        >>> unwound.__context__ = OSError("write")
        >>> unwound.__context__.__context__ = KeyboardInterrupt()
        >>> an_interrupt(KeyboardInterrupt()), an_interrupt(wrapped), an_interrupt(unwound), an_interrupt(RuntimeError())
        (True, True, True, False)
    """
    return interrupt_in(err) is not None


def interrupt_in(err: BaseException | None) -> KeyboardInterrupt | None:
    """The Ctrl-C ``err`` is, or carries in its chain (``__cause__``, else ``__context__``):
    :func:`an_interrupt`'s, None when none."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:  # (a chain may loop back on itself)
        if isinstance(err, KeyboardInterrupt):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def user_code(said: str = "", *, error: Callable[[str], InputError] | None = None) -> Iterator[None]:
    """Around the user's code (a factory's import and ``build``, its data, its model's first
    forward and loss, validate's predict): whatever it raises, ``SystemExit`` and
    ``GeneratorExit`` too, is one :class:`InputError` line, ``said`` and then :func:`raised`
    (or ``error(raised(...))``, an ``InputError`` of the caller's kind). Ours (an ``InputError``)
    passes, and so does a Ctrl-C, also one Python wrapped on its way out (:func:`an_interrupt`:
    exit 130, not bad input).

    Example::

        >>> with user_code("task.factory toy.py:build raised "):
        ...     raise SystemExit(3)
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: task.factory toy.py:build raised SystemExit: 3
    """
    try:
        yield
    except InputError:
        raise
    except BaseException as err:  # noqa: BLE001 - the user's code: any failure is bad input
        if an_interrupt(err):
            raise
        raise (error(raised(err)) if error is not None else InputError(f"{said}{raised(err)}")) from None


def check_folder_of(path: Path, where: str) -> None:
    """Refuse (one :class:`InputError` line, ``where`` first) an output ``path`` whose folder does
    not exist or is not a folder: a typo in a folder name makes no stray folders.

    Example::

        >>> check_folder_of(Path(__file__), "--out")
        >>> check_folder_of(Path("/no/such/folder/x.png"), "--out")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: --out: folder /no/such/folder does not exist
    """
    parent = path.parent
    if not parent.is_dir():
        raise InputError(f"{where}: folder {parent} does not exist" if not parent.exists()
                         else f"{where}: {parent} is not a folder")


class Reached(NamedTuple):
    """What ``mkdir -p`` does with a folder's path (:func:`as_made`)."""

    folder: Path
    """The folder it makes or reaches, as the OS resolves the path (links followed, each ``..``
    the OS's)."""
    made_in: tuple[Path, ...]
    """The existing folders it makes a folder in, in the order it makes them (none when the
    folder exists): where it must be able to write."""
    blocked: Path | None
    """The existing path it stops at, one that is not a folder (a file, a link to nothing, a
    loop), or None: it makes the folder."""
    itself: bool
    """``blocked`` is the path's own last part (the folder *is* it, rather than lies under it)."""


def as_made(folder: Path) -> Reached:
    """What ``mkdir -p folder`` (``Path.mkdir(parents=True, exist_ok=True)``, ``os.makedirs``)
    does, judged as the OS walks the path, part by part, without making anything: an existing
    part that is a folder, or a link to one, is gone into (its target: ``link/..`` is the parent
    of the link's target, not the link's own folder); one that is not (a file, a link to nothing,
    a loop) stops it, ``blocked``; a missing part is made, and a ``..`` after it walks back over
    it (``nodir/../file.txt`` is ``file.txt``, with ``nodir`` made on the way). What normalising
    the text got wrong: ``file.txt/..`` is no folder (the OS's ``ENOTDIR``), and ``gone/..`` of a
    dangling link ``gone`` is not ``.``. An ``OSError`` (a part this user may not search) is
    raised, and so is one for what ``mkdir`` would refuse before any OS call looks at it: a NUL
    byte in the path (``EINVAL``; pathlib's ``is_dir`` says False, ``mkdir`` raises
    ``ValueError``), a part to be made longer than the file system's ``NAME_MAX``
    (``ENAMETOOLONG``, naming it).

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp()).resolve()
        >>> _ = (root / "file.txt").write_text("mine"); (root / "real").mkdir()
        >>> (root / "link").symlink_to(root / "real"); (root / "gone").symlink_to(root / "nowhere")
        >>> made = as_made(root / "link" / ".." / "new" / "sub")  # (link/..: real's parent, root)
        >>> made.folder == root / "new" / "sub", made.made_in == (root,), made.blocked
        (True, True, None)
        >>> made = as_made(root / "nodir" / ".." / "file.txt" / "sub")  # (nodir made, walked back over)
        >>> made.blocked == root / "file.txt", made.itself
        (True, False)
        >>> as_made(root / "gone" / ".." / "x").blocked == root / "gone", as_made(root / "link").folder == root / "real"
        (True, True)
        >>> for bad in (root / "a\\0b" / "c", root / "new" / ("x" * 300)):
        ...     try:
        ...         as_made(bad)
        ...     except OSError as err:
        ...         print(errno.errorcode[err.errno], err.strerror)
        EINVAL a NUL byte (\\0) is in it, which no path may hold
        ENAMETOOLONG File name too long
        >>> shutil.rmtree(root)
    """
    folder = Path(folder)
    if "\0" in os.fsdecode(folder):  # (is_dir would say False, as if it were not there)
        raise OSError(errno.EINVAL, "a NUL byte (\\0) is in it, which no path may hold", os.fsdecode(folder))
    if folder.is_dir():  # (the OS's own answer: there already)
        return Reached(folder.resolve(), (), None, False)
    parts = folder.absolute().parts
    at, made, made_in = Path(parts[0]), 0, []  # `at`: where the walk is, resolved; its last `made` parts are new
    for k, part in enumerate(parts[1:], 2):
        if part == "..":  # (a made folder walked back over, or the resolved folder's parent: the OS's `..`)
            at, made = at.parent, max(made - 1, 0)
            continue
        step = at / part
        if not made:
            if step.is_dir():
                at = step.resolve()
                continue
            if step.is_symlink() or step.exists():  # (not a folder: mkdir cannot make it one, nor go under it)
                return Reached(step, tuple(made_in), step, k == len(parts))
            if at not in made_in:
                made_in.append(at)
        if name_too_long(made_in[-1], part):  # (a part to be made: no stat said it was too long)
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), os.fspath(step))
        at, made = step, made + 1
    return Reached(at, tuple(made_in), None, False)


def name_too_long(parent: Path, name: str) -> bool:
    """Whether ``name`` is longer than a folder's name in ``parent`` may be: its file system's
    ``NAME_MAX`` bytes (``os.pathconf``), else 255; where there is no ``os.pathconf`` (Windows, whose
    ``os`` lacks it: review 55o, a new ``out_dir`` was an ``AttributeError``), 255 UTF-16 code units,
    NTFS's limit (and exFAT's, ReFS's).

    Example::

        >>> name_too_long(Path("."), "x" * 255), name_too_long(Path("."), "x" * 256)
        (False, True)
    """
    pathconf = getattr(os, "pathconf", None)
    if pathconf is None:
        return len(name.encode("utf-16-le", "surrogatepass")) > 2 * 255
    try:
        name_max = pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    return len(os.fsencode(name)) > name_max


MAX_PATH_SHOWN = 200
"""The most characters of a path a one-line refusal shows (:func:`shown`): a path the OS refuses
as too long (``ENAMETOOLONG``) is thousands."""


def shown(path: str | os.PathLike) -> str:
    r"""A path for a one-line refusal: as it is, unless it holds a control character (a newline
    would split the line, :func:`has_control`) or a byte that is not UTF-8 (printed, it raises),
    then its ``repr``; cut to :data:`MAX_PATH_SHOWN` characters around ``...`` (:func:`shortened`).

    Example::

        >>> shown(Path("runs/a b/steps.csv")), shown("a\nb/guard"), len(shown("x" * 5000))
        ('runs/a b/steps.csv', "'a\\nb/guard'", 200)
    """
    text = os.fsdecode(path)
    if has_control(text) or any("\ud800" <= c <= "\udfff" for c in text):
        text = repr(text)
    return shortened(text, MAX_PATH_SHOWN)


def looked_at(path: str | os.PathLike, err: OSError) -> str:
    """Why ``path`` ``cannot be looked at`` (an ``OSError`` from ``stat``: a part this user may
    not search, a name too long), for a one-line refusal: the OS's words, and the part it named
    when that is not ``path`` itself (a too-long path was written twice in full).

    Example::

        >>> looked_at(Path("x" * 300), OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300))[-45:]
        'xxxxx cannot be looked at: File name too long'
        >>> looked_at(Path("/a/b/c"), PermissionError(errno.EACCES, "Permission denied", "/a/b"))
        '/a/b/c cannot be looked at: Permission denied (/a/b)'
    """
    named = err.filename if err.filename is not None and os.fsdecode(err.filename) != os.fsdecode(path) else None
    return (f"{shown(path)} cannot be looked at: {failed_because(err)}"
            + (f" ({shown(named)})" if named is not None else ""))


def _kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, for a refusal: a named pipe, a device, ..."""
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file"


def what_is(path: Path) -> str:
    """What ``path``, which exists or is a link and is not a folder, is, for a refusal: a file
    (a named pipe, a device, a socket), or a symbolic link to nothing, through a file, to a file,
    or one that loops.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = (root / "file.txt").write_text("mine"); (root / "loop").symlink_to(root / "loop")
        >>> (root / "gone").symlink_to("nowhere"); (root / "via").symlink_to(root / "file.txt" / "sub")
        >>> [what_is(root / name).replace(str(root), "DIR") for name in ("file.txt", "loop", "gone", "via")]
        ['a file', 'a symbolic link that loops', 'a symbolic link to DIR/nowhere, which does not exist', 'a symbolic link to DIR/file.txt/sub, which goes through a file']
        >>> os.mkfifo(root / "pipe"); (root / "null").symlink_to("/dev/null")
        >>> what_is(root / "pipe"), what_is(root / "null")
        ('a named pipe', 'a symbolic link to /dev/null, a device')
        >>> shutil.rmtree(root)
    """
    if not path.is_symlink():
        return _kind(os.lstat(path).st_mode)
    target = Path(os.readlink(path))
    target = target if target.is_absolute() else path.parent / target
    try:
        path.resolve(strict=True)
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return f"a symbolic link to {shown(target)}, which does not exist"
    except NotADirectoryError:  # (a target through a file: link -> file.txt/sub)
        return f"a symbolic link to {shown(target)}, which goes through a file"
    except (RuntimeError, OSError):  # (a loop: RuntimeError in Python < 3.13, OSError ELOOP after)
        return "a symbolic link that loops"
    return f"a symbolic link to {shown(target)}, {_kind(mode)}"


def folder_problem(folder: Path) -> str | None:
    r"""Why ``mkdir -p folder`` cannot make or reach ``folder`` (:func:`as_made`), in words for a
    one-line refusal (the caller puts its ``where`` first; each path :func:`shown`), or None when
    it can: what the Lightning plugin's ``csv=``, the Hugging Face callback's ``out_dir`` and
    W&B's ``log.wandb.dir`` are judged by first, before anything trains (:func:`unwritable`).

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp()).resolve()
        >>> _ = (root / "notes.txt").write_text("mine"); (root / "gone").symlink_to(root / "nowhere")
        >>> folder_problem(root / "new" / "deeper") is None, folder_problem(root / "nodir" / "..") is None
        (True, True)
        >>> for path in (root / "notes.txt", root / "notes.txt" / "..", root / "gone" / ".." / "x"):
        ...     print(folder_problem(path).replace(str(root), "DIR"))
        DIR/notes.txt is a file, not a folder
        DIR/notes.txt/.. lies under DIR/notes.txt, a file, not a folder
        DIR/gone/../x lies under DIR/gone, a symbolic link to DIR/nowhere, which does not exist, not a folder
        >>> _ = (root / "a\nb").write_text("mine")
        >>> print(folder_problem(root / "a\nb" / "guard").replace(str(root), "DIR"))
        'DIR/a\nb/guard' lies under 'DIR/a\nb', a file, not a folder
        >>> print(folder_problem(Path("x" * 300))[-45:])
        xxxxx cannot be looked at: File name too long
        >>> print(folder_problem(root / "new" / ("x" * 300))[-45:])  # (a part to be made: mkdir -p would fail)
        xxxxx cannot be looked at: File name too long
        >>> print(folder_problem(root / "a\0b" / "c").replace(str(root), "DIR"))
        'DIR/a\x00b/c' holds a NUL byte (\0), which no path may hold
        >>> shutil.rmtree(root)
    """
    if "\0" in os.fsdecode(folder):  # (pathlib says such a path is not there; mkdir raises ValueError)
        return f"{shown(folder)} holds a NUL byte (\\0), which no path may hold"
    try:
        reached = as_made(folder)
        if reached.blocked is None:
            return None
        what = what_is(reached.blocked)
    except OSError as err:  # (a parent this user may not search, a name too long: no raw OSError)
        return looked_at(folder, err)
    if reached.itself:
        return f"{shown(folder)} is {what}, not a folder"
    return f"{shown(folder)} lies under {shown(reached.blocked)}, {what}, not a folder"


def unwritable(folder: Path) -> str | None:
    """Why this process cannot make ``folder`` (``mkdir -p``) and write its files in it, in words
    for a one-line refusal (the caller puts its ``where`` first), or None when it can: first
    :func:`folder_problem` (a file, a link to nothing or a loop on the way), then a real file made
    and removed (``tempfile.TemporaryFile``, one byte written to it) in each existing folder
    ``mkdir -p`` would make a folder in (:func:`as_made`), or in ``folder`` itself when it exists.
    Made, not asked (``os.access``): root passes ``os.access`` on ``/proc`` and ``/sys``, where
    nothing can be made, and a read-only file system, a full disk or quota (where the file system
    says so when a byte is written, as local ones do; not one that says so only when the data
    reaches the disk, as some network ones) or a file size limit (``ulimit -f 0``) is only found
    by trying. What the
    Lightning plugin's ``csv=``, the Hugging Face callback's ``out_dir`` and ``log.wandb.dir``
    are all judged by, before anything trains.

    Example::

        >>> import shutil, tempfile
        >>> root = Path(tempfile.mkdtemp()).resolve()
        >>> unwritable(root / "new" / "deeper"), unwritable(root), sorted(root.iterdir())  # (nothing left)
        (None, None, [])
        >>> _ = (root / "notes.txt").write_text("mine")
        >>> print(unwritable(root / "notes.txt" / "sub").replace(str(root), "DIR"))
        DIR/notes.txt/sub lies under DIR/notes.txt, a file, not a folder
        >>> said = unwritable(Path("/proc/ampguard")) if Path("/proc/self").is_dir() else "skipped"  # (root too)
        >>> said in ("/proc/ampguard cannot be made: no file can be made in /proc (No such file or directory)",
        ...          "/proc/ampguard cannot be made: /proc is not a folder this user may write in", "skipped")
        True
        >>> shutil.rmtree(root)
    """
    problem = folder_problem(folder)
    if problem is not None:
        return problem
    try:
        reached = as_made(folder)
    except OSError as err:  # (changed since folder_problem looked)
        return looked_at(folder, err)
    for place in reached.made_in or (reached.folder,):
        try:
            with tempfile.TemporaryFile(dir=place, buffering=0) as probe:
                probe.write(b"\n")  # (a full disk or quota: found by a byte, not by an empty file)
        except OSError as err:
            why = (f"{shown(place)} is not a folder this user may write in" if err.errno in (errno.EACCES, errno.EPERM)
                   else f"no file can be made in {shown(place)} ({failed_because(err)})")
            return f"{shown(folder)} cannot be made: {why}" if reached.made_in else why
    return None
