"""Checkpoints that survive a kill and never run code on load.

Saving is atomic: the payload goes to a temporary file in the same folder, is flushed and
fsync'ed, then ``os.replace``'d over its final name, so a run killed at any moment (during a
save included) leaves every earlier checkpoint whole. Loading uses
``torch.load(weights_only=True)`` only: tensors and plain data come back, and a file carrying
pickled code is refused before any of it runs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import pickletools
import random
import re
import time
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from .errors import InputError, brief, counted, first_line, shown
from .files import _at, _let_go, _make_temporary, _reached, _sync, remove_temporaries

MAGIC = "ampguard-checkpoint"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{8,})\.pt$")  # (8 digits, more from step 10**8 on)
_PARTIAL = re.compile(r"^\.step-\d{8,}\.pt\.tmp-(\d+)(?:-[0-9a-f]+)?$")  # (.NAME.tmp-PID-RANDOM; older: .tmp-PID)
REQUIRED = ("magic", "format", "step", "config", "model", "optimizer", "state", "scheduler", "rng", "data_position")
NOT_OURS = ("not an ampguard checkpoint (a plain PyTorch state_dict? load it into the model in your "
            "task.factory's build)")
"""What :func:`load_checkpoint` says of a file that is no ampguard checkpoint, with the way on for
the likeliest one, a plain loop's weights: ``--resume``, ``validate`` and ``locate --checkpoint``
take ampguard's own alone, a factory's ``build`` loads any (README "Checkpoints and resume")."""


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint taken after ``step``: zero-padded, so names sort by step.

    Example::

        >>> checkpoint_name(7), checkpoint_name(12345678)
        ('step-00000007.pt', 'step-12345678.pt')
        >>> sorted([checkpoint_name(10), checkpoint_name(9)])
        ['step-00000009.pt', 'step-00000010.pt']
    """
    return f"step-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """Every RNG a run may draw from: torch (CPU and CUDA), numpy's global one, ``random``.

    Example (restored by :func:`set_rng_state`, every generator draws the same numbers again)::

        >>> import numpy as np
        >>> saved = rng_state()
        >>> sorted(saved) == sorted(["torch", "random", "numpy"] + (["cuda"] if torch.cuda.is_available() else []))
        True
        >>> first = torch.rand(2), random.random(), np.random.rand()
        >>> set_rng_state(saved)
        >>> again = torch.rand(2), random.random(), np.random.rand()
        >>> torch.equal(first[0], again[0]), first[1:] == again[1:]
        (True, True)
    """
    state = rng_snapshot()
    if "numpy" in state:  # (as a checkpoint file holds it: a tensor of its keys, plain numbers)
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)}
    return state


def torch_rng_state() -> dict[str, Any]:
    """Torch's RNGs alone (CPU and CUDA), what dropout draws from: :func:`rng_state`'s cheap part
    (a few us; NumPy's and ``random``'s states cost ~45 us more), put back by :func:`set_rng_state`.

    Example::

        >>> saved = torch_rng_state()
        >>> first = torch.rand(2)
        >>> set_rng_state(saved)
        >>> torch.equal(torch.rand(2), first), "random" in saved
        (True, False)
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def rng_snapshot() -> dict[str, Any]:
    """Every RNG :func:`rng_state` saves, as they stand, to put back in this process alone
    (:func:`set_rng_state`), never written: NumPy's state kept as ``np.random.get_state()``
    returns it, without :func:`rng_state`'s conversion for a checkpoint file. Review 53h: the
    trainer took :func:`rng_state` at every accumulation group's start for the rare data that
    fails inside a group; measured by part, NumPy's ``get_state()`` (~35 us, its 624 words copied
    one by one) and ``random.getstate()`` (~8 us) are the cost and the conversion ~5 us, so a task
    whose data cannot draw from NumPy or ``random`` takes :func:`torch_rng_state` instead.

    Example::

        >>> import numpy as np
        >>> saved = rng_snapshot()
        >>> first = torch.rand(2), random.random(), np.random.rand()
        >>> set_rng_state(saved)
        >>> again = torch.rand(2), random.random(), np.random.rand()
        >>> torch.equal(first[0], again[0]), first[1:] == again[1:], type(saved["numpy"]) is tuple
        (True, True, True)
    """
    state = {**torch_rng_state(), "random": random.getstate()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with matplotlib
        return state
    state["numpy"] = np.random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the RNGs :func:`rng_state` saved (the CUDA ones only where CUDA is available),
    or :func:`rng_snapshot` or :func:`torch_rng_state` took.

    Example (a state that went through a checkpoint file, its tuples turned into lists)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> path = save_checkpoint(folder / "rng.pt", {"rng": rng_state()})
        >>> expected = random.random(), torch.rand(1)
        >>> set_rng_state(safe_load(path)["rng"])
        >>> random.random() == expected[0], torch.equal(torch.rand(1), expected[1])
        (True, True)
        >>> shutil.rmtree(folder)
    """
    torch.set_rng_state(state["torch"])
    if "random" in state:  # (torch_rng_state's holds torch's alone)
        kept = state["random"]  # review 54o: random.getstate()'s own tuple as it is (rebuilt, its 625 words cost
        # ~100 us an evaluation's rng_kept); one from a checkpoint file, its tuples made lists, made tuples again
        whole = isinstance(kept, tuple) and len(kept) > 1 and isinstance(kept[1], tuple)
        random.setstate(kept if whole else _as_tuple(kept))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        if isinstance(s, tuple):  # (rng_snapshot's, as np.random.get_state() gave it)
            np.random.set_state(s)
        else:
            np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["gauss"]))




def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


WORKER_DIED = "DataLoader worker (pid"
"""How the error of torch's SIGCHLD handler begins (``torch.utils.data._utils.signal_handling``:
a worker process of a ``DataLoader`` the process reads has died)."""


@contextlib.contextmanager
def child_exits_held() -> Iterator[None]:
    """SIGCHLD's Python handler held back for the block: a child's exit in it is noted, and the
    handler run for it once the block is over, on every path (the handler put back first).

    Torch's ``DataLoader`` with worker processes sets a handler that raises ``DataLoader worker
    (pid N) exited unexpectedly`` wherever the main thread is when a worker dies (an OOM kill):
    in a checkpoint's write it cut the save short (the checkpoint lost, a traceback, exit 1), at
    a data read it was bad data (exit 2, the checkpoint kept), by timing (review 58d). Run after
    the write, that error is passed over: the worker is the data's, and its loader says it died at
    its next read (torch looks at its workers while a read waits on one), a bad batch; any other
    error of a handler goes on.

    Only SIGCHLD's handler: SIGINT, SIGTERM (:mod:`~ampguard.signals`) and every other signal are
    handled as ever. Not by blocking it (``pthread_sigmask``): that is the calling thread's mask,
    and another thread that does not block it (a torch or a sink's thread) takes the signal, and
    Python runs the handler on the main thread all the same. Main thread only (where a handler can
    be set: elsewhere the block runs as it is); nothing to hold where the handler is not Python's
    (``SIG_DFL``: nothing raises) or the platform has no SIGCHLD.

    Example (a handler that raises as torch's does: held, it runs once the block is over)::

        >>> import signal
        >>> def torch_like(signum, frame):
        ...     raise RuntimeError("DataLoader worker (pid(s) 4242) exited unexpectedly")
        >>> before = signal.signal(signal.SIGCHLD, torch_like)
        >>> with child_exits_held():
        ...     signal.raise_signal(signal.SIGCHLD)  # (a worker died)
        ...     print("the write goes on")
        the write goes on
        >>> signal.getsignal(signal.SIGCHLD) is torch_like
        True
        >>> _ = signal.signal(signal.SIGCHLD, before)
    """
    import signal
    import threading

    child = getattr(signal, "SIGCHLD", None)
    handler = signal.getsignal(child) if child is not None else None
    if not callable(handler) or threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    signal.signal(child, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        try:
            try:  # (a pending handler of another signal that raises here leaves SIGCHLD's: set it again)
                signal.signal(child, handler)
            finally:
                if signal.getsignal(child) is not handler:
                    signal.signal(child, handler)
            if noted:
                signal.raise_signal(child)  # (its handler runs here, as for the signal that came)
        except RuntimeError as err:
            if not str(err).startswith(WORKER_DIED):
                raise


def save_checkpoint(path: str | os.PathLike, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the ampguard marker) to ``path`` atomically; return the path.

    The payload goes to a temporary file beside ``path`` first, is fsync'ed, then replaces
    ``path``: no reader ever sees half a file. ``torch.save`` copies CUDA tensors in the payload
    to the host, a host sync.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> path = save_checkpoint(folder / "ckpt" / "step-00000003.pt", {"step": 3, "w": torch.ones(2)})
        >>> [p.name for p in path.parent.iterdir()]  # the folder is made; no temporary file is left
        ['step-00000003.pt']
        >>> payload = torch.load(path, weights_only=True)
        >>> payload["magic"], payload["format"], payload["step"], payload["w"].tolist()
        ('ampguard-checkpoint', 1, 3, [1.0, 1.0])
        >>> shutil.rmtree(folder)
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the folder reached as a file replaced whole reaches its own (each link on the way judged), the temporary
    # file made at a name no one can guess, new, never through what lies there (review 55d: a predictable
    # .NAME.tmp-PID opened following links had a root resume write a checkpoint over a file a link led to)
    folder, target = _reached(path, False, path)  # (the plain path where the OS cannot walk: Windows)
    # (a DataLoader worker that dies in the write, its folder's fsync included, is said at the data's next read)
    with child_exits_held():
        try:
            tmp, fd = _make_temporary(folder, target.name, 0o666, os.fspath(target.parent))
            (at, at_fd), renamed = _at(folder, tmp), False
            try:
                with open(fd, "wb") as f:
                    torch.save({"magic": MAGIC, "format": FORMAT, **payload}, f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(at, _at(folder, target.name)[0], src_dir_fd=at_fd, dst_dir_fd=at_fd)
                renamed = True
            finally:
                if not renamed:
                    with contextlib.suppress(OSError):
                        os.unlink(at, dir_fd=at_fd)
            if isinstance(folder, int):  # (a folder the plain path cannot open cannot be synced)
                _sync(folder)
        finally:
            _let_go(folder)
    return path


def safe_load(path: str | os.PathLike, what: str = "checkpoint", map_location: str | torch.device = "cpu") -> Any:
    """``torch.load(weights_only=True)``, with every failure turned into one :class:`InputError`
    line: a file with pickled code in it is refused and that code never runs.

    A file the weights-only loader refuses is told apart by its bytes, not by torch's message: a
    whole pickle stream (a ``torch.save`` zip's ``data.pkl``, or a bare pickle) holds objects the
    loader does not allow; anything else is unreadable.

    Example (a ``Path`` is a pickled object, not plain data; a cut-off file or text is unreadable)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"x": torch.zeros(1)}, folder / "plain.pt")
        >>> safe_load(folder / "plain.pt")
        {'x': tensor([0.])}
        >>> torch.save({"where": Path("elsewhere")}, folder / "object.pt")
        >>> _ = (folder / "torn.pt").write_bytes((folder / "plain.pt").read_bytes()[:100])
        >>> _ = (folder / "text.pt").write_bytes(b"not a checkpoint")
        >>> for name in ("object.pt", "torn.pt", "text.pt", "missing.pt"):
        ...     try:
        ...         safe_load(folder / name, "batch")
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        DIR/object.pt: refused by the weights-only loader: it holds pickled objects ... (nothing in it was run)
        DIR/torn.pt: unreadable batch (truncated, or not a PyTorch file)
        DIR/text.pt: unreadable batch (truncated, or not a PyTorch file)
        no batch file at DIR/missing.pt
        >>> shutil.rmtree(folder)
    """
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder, not a {what} file")
    if not path.is_file():
        raise InputError(f"no {what} file at {path}")
    damaged = _failed_checksum(path)
    if damaged:
        raise InputError(f"{path}: damaged {what}: its {damaged} fails its checksum (the bytes changed after it "
                         "was written: a disk or copy error)")
    try:
        with warnings.catch_warnings():  # torch's note on a file pickled with another protocol: no one's business
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        if _whole_pickle(path):  # a real pickle the weights-only loader said no to
            raise InputError(
                f"{path}: refused by the weights-only loader: it holds pickled objects or bytes beyond tensors "
                "and plain data (nothing in it was run)"
            ) from None
        raise InputError(f"{path}: unreadable {what} (truncated, or not a PyTorch file)") from None
    except Exception:  # noqa: BLE001 - torch's loaders raise many kinds on junk bytes; all mean the same
        raise InputError(f"{path}: unreadable {what} (truncated, or not a PyTorch file)") from None


def _failed_checksum(path: Path) -> str | None:
    """The first part of a ``torch.save`` zip whose bytes do not match the CRC-32 written with
    them (``torch.load`` does not check it: a flipped bit in a tensor loaded as a wrong weight), or
    None. A part saved without one (``torch.utils.serialization.config.save.compute_crc32 =
    False`` writes 0) is not checked; a file that is not a zip is left to the loader.

    Example::

        >>> import tempfile
        >>> file = Path(tempfile.mkdtemp()) / "w.pt"
        >>> torch.save({"w": torch.ones(64)}, file)
        >>> _failed_checksum(file) is None
        True
        >>> data = bytearray(file.read_bytes())
        >>> at = data.index(torch.ones(64).numpy().tobytes())  # the tensor's bytes, stored as they are
        >>> data[at] ^= 1
        >>> _ = file.write_bytes(bytes(data))
        >>> _failed_checksum(file)
        'w/data/0'
    """
    try:
        if not zipfile.is_zipfile(path):
            return None
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.CRC == 0:  # (written without one)
                    continue
                try:
                    with archive.open(info) as part:
                        while part.read(1 << 24):
                            pass
                except zipfile.BadZipFile:
                    return info.filename
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):  # unreadable: the loader says so
        return None
    return None


def _whole_pickle(path: Path) -> bool:
    """Whether ``path`` holds a complete pickle stream (in a ``torch.save`` zip: its ``data.pkl``).
    Only the opcodes are read (``pickletools.genops``); nothing is unpickled, nothing runs."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
                if not names:
                    return False
                with archive.open(names[0]) as stream:
                    return _opcodes_to_stop(stream)
        with open(path, "rb") as stream:
            return _opcodes_to_stop(stream)
    except Exception:  # noqa: BLE001 - any failure to read the stream means: not a pickle
        return False


def _opcodes_to_stop(stream: Any) -> bool:
    for _ in pickletools.genops(stream):  # raises ValueError on an unknown opcode or an early end
        pass
    return True


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load an ampguard checkpoint, or raise :class:`InputError` saying why it cannot be used.

    Only ``torch.load(weights_only=True)``: a file with pickled code in it is refused and that
    code never runs; a truncated or foreign file is refused too.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"model": {}}, folder / "foreign.pt")
        >>> _ = save_checkpoint(folder / "partial.pt", {"step": 1, "model": {}})
        >>> for name in ("foreign.pt", "partial.pt"):
        ...     try:
        ...         load_checkpoint(folder / name)
        ...     except InputError as err:
        ...         print(str(err).replace(str(folder), "DIR"))
        DIR/foreign.pt: not an ampguard checkpoint (a plain PyTorch state_dict? load it into the model in your task.factory's build)
        DIR/partial.pt: incomplete ampguard checkpoint (missing config, optimizer, state, scheduler, rng, data_position)
        >>> complete = {key: {} for key in REQUIRED if key not in ("magic", "format")}
        >>> load_checkpoint(save_checkpoint(folder / "whole.pt", {**complete, "step": 1}))["step"]
        1
        >>> shutil.rmtree(folder)
    """
    path = Path(path)
    payload = safe_load(path, "checkpoint", map_location)
    # review 54n: a field of the loaded file is compared only once its type is the one expected: a
    # format of tensor([1, 2]) made "!=" a tensor whose truth raised a RuntimeError, a traceback,
    # and no InputError, so a run folder's resume died there instead of trying the older checkpoint
    # (a magic of a tensor was refused only because Tensor != str happens to be True; True == 1)
    if not isinstance(payload, dict) or not _exactly(payload.get("magic"), MAGIC):
        # (review 56d: a plain loop's model.state_dict() met this line with no way forward)
        raise InputError(f"{path}: {NOT_OURS}")
    if not _exactly(payload.get("format"), FORMAT):
        # (brief: a container by its kind; its repr could recurse past the limit)
        raise InputError(f"{path}: checkpoint format {brief(payload.get('format'))}, this ampguard reads {FORMAT}")
    missing = [key for key in REQUIRED if key not in payload]
    if missing:
        raise InputError(f"{path}: incomplete ampguard checkpoint (missing {', '.join(missing)})")
    return payload


def _exactly(value: Any, expected: str | int) -> bool:
    """Whether ``value``, read from a file, is ``expected`` and of its very type (not a bool for an
    int, not a tensor, whose ``==`` is a tensor).

    Example::

        >>> _exactly(1, 1), _exactly(True, 1), _exactly(1.0, 1), _exactly(torch.tensor([1, 2]), 1), _exactly("a", "a")
        (True, False, False, False, True)
    """
    return type(value) is type(expected) and value == expected


def load_weights(model: torch.nn.Module, path: str | os.PathLike,
                 map_location: str | torch.device = "cpu", *, task: Mapping[str, Any] | None = None,
                 data_id: str | None = None) -> dict[str, Any]:
    """Load a checkpoint's model weights into ``model`` (one line of :class:`InputError` when the
    file is unusable or the weights do not fit, saying how: :func:`misfit`; with ``task``, the
    config's ``task`` section the model is built from, also which task the checkpoint was of when
    another: :func:`other_task`; with ``data_id``, the task's data as the machine provides it, a
    checkpoint trained on other data, :func:`other_data`); return the whole payload.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> saved = torch.nn.Linear(2, 1)
        >>> payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
        >>> path = save_checkpoint(folder / "step-00000004.pt", {**payload, "step": 4, "model": saved.state_dict()})
        >>> model = torch.nn.Linear(2, 1)
        >>> load_weights(model, path)["step"], torch.equal(model.weight, saved.weight)
        (4, True)
        >>> try:
        ...     load_weights(torch.nn.Linear(3, 1), path)
        ... except InputError as err:
        ...     print(str(err).replace(str(folder), "DIR"))
        DIR/step-00000004.pt: does not fit this model (weight: checkpoint [1, 2], model [1, 3])
        >>> shutil.rmtree(folder)
    """
    payload = load_checkpoint(path, map_location)
    for key in ("model", "state"):
        if not isinstance(payload[key], Mapping):
            raise InputError(f"{path}: bad checkpoint: {key} is a {type(payload[key]).__name__}, expected a mapping")
    if bad := not_weights(payload["model"]):  # (review 54n: it was torch's "Error(s) in loading state_dict for X:")
        raise InputError(f"{path}: bad checkpoint: {bad}")
    how = misfit(model.state_dict(), payload["model"])  # (before loading: load_state_dict casts a dtype)
    if not how:
        try:
            model.load_state_dict(payload["model"])
        except (RuntimeError, TypeError, ValueError, KeyError) as err:
            how = first_line(err)
    if how:
        saved = payload["config"].get("task") if isinstance(payload["config"], Mapping) else None
        raise InputError(f"{path}: does not fit this model ({how}){other_task(saved, task)}")
    other_data(payload, path, data_id)
    return payload


DATA_ID = "data_id"
"""The payload key of what identifies the task's data where the machine provides it."""


def other_data(payload: Mapping[str, Any], path: str | os.PathLike, data_id: str | None) -> None:
    """Refuse (one :class:`InputError` line naming both) a checkpoint whose ``data_id`` (its task's
    data where the machine provides it: charlm's corpus is the running Python's standard library)
    is not ``data_id``, this process's; either missing: nothing to compare. A ``data_id`` that is
    not text is a bad checkpoint.

    Example::

        >>> other_data({"data_id": "corpus a"}, "step-00000002.pt", "corpus a")
        >>> other_data({"data_id": "corpus a"}, "step-00000002.pt", "corpus b")
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: step-00000002.pt: it was trained on other data: corpus a; this process's is corpus b
    """
    saved = payload.get(DATA_ID)
    if saved is not None and not isinstance(saved, str):
        raise InputError(f"{path}: bad checkpoint: data_id is {saved!r}, expected a str")
    if saved is not None and data_id is not None and saved != data_id:
        raise InputError(f"{path}: it was trained on other data: {saved}; this process's is {data_id}")


def other_task(saved: Any, now: Mapping[str, Any] | None) -> str:
    """When a checkpoint's ``task`` section (``saved``) names another workload than the config's
    (``now``): which, and how to ask for it; else "". A factory is the workload when set.

    Example::

        >>> other_task({"name": "digits"}, {"name": "charlm"})
        "; it is a checkpoint of task digits, this config's is charlm: pass that run's config.yaml, or --set task.name=digits"
        >>> other_task({"name": "charlm", "factory": "my_model.py:build"}, {"name": "charlm", "factory": None})
        "; it is a checkpoint of task.factory my_model.py:build, this config's is charlm: pass that run's config.yaml, or --set task.factory=my_model.py:build"
        >>> other_task({"name": "linear"}, {"name": "charlm", "factory": "f.py:build"}).split(", or ")[1]
        '--set task.factory=null --set task.name=linear'
        >>> other_task({"name": "linear"}, {"name": "linear"}), other_task(None, {"name": "linear"})
        ('', '')
    """
    if not isinstance(saved, Mapping) or now is None:
        return ""

    def workload(task: Mapping[str, Any]) -> str | None:  # "task.factory f.py:build" or "task digits"
        factory, name = task.get("factory"), task.get("name")
        if isinstance(factory, str):
            return f"task.factory {factory}"
        return f"task {name}" if isinstance(name, str) else None

    was, this = workload(saved), workload(now)
    if was is None or this is None or was == this:
        return ""
    key, _, value = was.partition(" ")
    ask = f"--set {'task.name' if key == 'task' else key}={value}"
    if isinstance(now.get("factory"), str) and not isinstance(saved.get("factory"), str):
        ask = "--set task.factory=null " + ask
    return f"; it is a checkpoint of {was}, this config's is {this.removeprefix('task ')}: pass that run's " \
           f"config.yaml, or {ask}"


def not_weights(saved: Mapping[Any, Any]) -> str:
    """The first entry of a checkpoint's ``model`` that no state dict holds, in a few words: a name
    that is not text, or a value that is not a tensor (a module's ``*_extra_state`` may be anything);
    "" when none. Named, because the load's own error names neither the entry nor what it holds
    (review 54n: a weight round-tripped through JSON, a list, read "Error(s) in loading state_dict
    for Linear:"). The one check of it: ``load_weights`` (validate, locate) and a resume's schema.

    Example::

        >>> not_weights({"w": torch.zeros(2), "m._extra_state": {"a": 1}})
        ''
        >>> not_weights({"w": [[0.0, 1.0]]}), not_weights({"w": "tensor"}), not_weights({3: torch.zeros(2)})
        ('model.w is a list of 1, expected a tensor', "model.w is 'tensor', expected a tensor", 'model holds a name 3, expected text')
    """
    for name, value in saved.items():
        if not isinstance(name, str):
            return f"model holds a name {brief(name)}, expected text"
        if not isinstance(value, torch.Tensor) and not name.endswith("_extra_state"):
            return f"model.{shown(name)} is {brief(value)}, expected a tensor"
    return ""


def misfit(model: Mapping[str, Any], saved: Mapping[str, Any]) -> str:
    """How a checkpoint's weights ``saved`` fail to fit a model's ``model`` (both state dicts), in
    a few words: the first tensor whose shape or dtype differs (``load_state_dict`` casts: int64
    weights were truncated to whole numbers, float16 ones lost their low bits, unsaid), else the
    names missing on either side (a count and the first); "" when neither (the load failed for
    another reason).

    Example::

        >>> a, b = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, {"w": torch.zeros(2, 4), "b": torch.zeros(2)}
        >>> misfit(a, b), misfit(a, {"w": a["w"]}), misfit({"w": a["w"]}, {**a, "x": 1, "y": 2}), misfit(a, a)
        ('w: checkpoint [2, 4], model [2, 3]', '1 weight of the model not in the checkpoint (b)', '3 weights of the checkpoint not in the model (b, ...)', '')
        >>> misfit(a, {**a, "b": a["b"].long()})
        'b: checkpoint int64, model float32'
    """
    for name, value in model.items():
        other = saved.get(name)
        if isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor) and not is_lazy(value):
            # (a lazy module's weight, not made yet, has no shape: the load makes it to the checkpoint's)
            if is_lazy(other):
                return f"{name}: checkpoint not made (a lazy module's), model {list(value.shape)}"
            if value.shape != other.shape:
                return f"{name}: checkpoint {list(other.shape)}, model {list(value.shape)}"
            if value.dtype != other.dtype:
                return f"{name}: checkpoint {dtype_name(other)}, model {dtype_name(value)}"
    parts = []
    for names, where in (([n for n in model if n not in saved], "of the model not in the checkpoint"),
                         ([n for n in saved if n not in model], "of the checkpoint not in the model")):
        if names:
            parts.append(f"{counted(len(names), 'weight')} {where} ({names[0]}{', ...' if len(names) > 1 else ''})")
    return "; ".join(parts)


def dtype_name(tensor: torch.Tensor) -> str:
    """A tensor's dtype as a line says it: ``"float32"``, not ``"torch.float32"``."""
    return str(tensor.dtype).removeprefix("torch.")


def non_finite_weight(saved: Mapping[str, Any]) -> str:
    """The first floating-point tensor of a checkpoint's weights that holds a NaN or an infinity,
    in a few words (``"fc.weight holds nan"``); "" when none. Such weights make every loss
    non-finite: a run resumed from them would skip every step (``validate`` and ``locate`` take
    them: judging and diagnosing a diverged model is their job).

    Example::

        >>> w = torch.ones(2, 2)
        >>> non_finite_weight({"w": w, "n": torch.tensor(3)}), non_finite_weight({"w": w, "b": torch.tensor([1.0, float("-inf")])})
        ('', 'b holds -inf')
    """
    for name, value in saved.items():
        # (float8 tensors have no isfinite: a model's saved weights are its master copies anyway)
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.element_size() > 1:
            finite = torch.isfinite(value)
            if not bool(finite.all()):
                return f"{name} holds {value[~finite][0].item():g}"
    return ""


def list_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The finished checkpoints in ``folder``, oldest first (temporary files are not listed).

    Example (by step, so past step 99,999,999, whose name has a ninth digit, too)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in ("step-100000000.pt", "step-00000010.pt", "step-00000002.pt", ".step-00000012.pt.tmp-99",
        ...              "notes.txt"):
        ...     _ = (folder / name).write_bytes(b"")
        >>> [p.name for p in list_checkpoints(folder)]
        ['step-00000002.pt', 'step-00000010.pt', 'step-100000000.pt']
        >>> list_checkpoints(folder / "missing")
        []
        >>> shutil.rmtree(folder)
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if _NAME.match(p.name)), key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step in a checkpoint's file name; -1 for a file not named like a checkpoint.

    Example::

        >>> checkpoint_step(Path("run/checkpoints/step-00000042.pt")), checkpoint_step(Path("step-42.pt"))
        (42, -1)
    """
    match = _NAME.match(path.name)
    return int(match.group(1)) if match else -1


def latest_loadable(
    folder: str | os.PathLike, map_location: str | torch.device = "cpu", before_step: int | None = None,
    check: Callable[[Path, dict[str, Any]], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint in ``folder`` that loads (taken before ``before_step`` if given);
    older ones are tried when newer ones do not load. ``check(path, payload)``, when given, is
    part of loading: a checkpoint it raises :class:`InputError` for counts as not loadable.

    Example (the newest file is torn, so the one before it answers)::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> payload = {key: {} for key in REQUIRED if key not in ("magic", "format")}
        >>> for step in (2, 4):
        ...     _ = save_checkpoint(folder / checkpoint_name(step), {**payload, "step": step})
        >>> _ = (folder / checkpoint_name(6)).write_bytes(b"torn")
        >>> path, loaded = latest_loadable(folder)
        >>> path.name, loaded["step"]
        ('step-00000004.pt', 4)
        >>> latest_loadable(folder, before_step=4)[0].name
        'step-00000002.pt'
        >>> try:
        ...     latest_loadable(folder, before_step=2)
        ... except InputError as err:
        ...     print(str(err).replace(str(folder), "DIR"))
        no checkpoint from before step 2 in DIR
        >>> shutil.rmtree(folder)
    """
    errors = []
    candidates = [p for p in list_checkpoints(folder) if before_step is None or checkpoint_step(p) < before_step]
    for path in reversed(candidates):
        try:
            payload = load_checkpoint(path, map_location)
            if check is not None:
                check(path, payload)
            return path, payload
        except InputError as err:
            errors.append(str(err))
    if errors:
        raise InputError(f"no loadable checkpoint in {folder} ({errors[0]})")
    when = f" from before step {before_step}" if before_step is not None else ""
    raise InputError(f"no checkpoint{when} in {folder}")


def set_aside_after(folder: str | os.PathLike, step: int) -> list[Path]:
    """Move checkpoints newer than ``step`` into ``folder/abandoned-<time>/``: a run resumed from
    an older checkpoint makes them a future that did not happen (its CSV rows go too), and a
    later ``--resume RUN_DIR`` must not pick them. They are kept, not deleted.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for step in (1, 2, 3):
        ...     _ = (folder / checkpoint_name(step)).write_bytes(b"")
        >>> [p.name for p in set_aside_after(folder, 1)]
        ['step-00000002.pt', 'step-00000003.pt']
        >>> [p.name for p in list_checkpoints(folder)]
        ['step-00000001.pt']
        >>> [sorted(q.name for q in p.iterdir()) for p in folder.iterdir() if p.name.startswith("abandoned-")]
        [['step-00000002.pt', 'step-00000003.pt']]
        >>> set_aside_after(folder, 1)  # nothing newer left: no new folder either
        []
        >>> _ = (folder / checkpoint_name(2)).write_bytes(b"another future")
        >>> _ = set_aside_after(folder, 1)  # in the same second: its own folder, the first one's files kept
        >>> sorted(len(list(p.iterdir())) for p in folder.iterdir() if p.name.startswith("abandoned-"))
        [1, 2]
        >>> shutil.rmtree(folder)
    """
    newer = [p for p in list_checkpoints(folder) if checkpoint_step(p) > step]
    if not newer:
        return []
    stamp = Path(folder) / time.strftime("abandoned-%Y%m%d-%H%M%S")
    for n in itertools.count(1):  # a folder of its own, even for two set-asides in the same second
        target = stamp if n == 1 else stamp.with_name(f"{stamp.name}-{n}")
        try:
            target.mkdir()
            break
        except FileExistsError:
            continue
    for path in newer:
        os.replace(path, target / path.name)
    return newer


def remove_partial(folder: str | os.PathLike, keep_pid: int | None = None) -> list[Path]:
    """Delete the partial saves (``.step-<N>.pt.tmp-<PID>-<RANDOM>``, an older ampguard's
    ``.step-<N>.pt.tmp-<PID>``) that runs killed during a save left
    in ``folder``, except those of process ``keep_pid`` (a save of its own in progress); return
    what was deleted. Such a file was never renamed to a checkpoint's name, so nothing loads it;
    it only takes space. A run calls this with no ``keep_pid`` when it starts, and with its own
    PID after every save.

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for name in (".step-00000005.pt.tmp-4242", ".step-00000007.pt.tmp-4242-0123456789abcdef",
        ...              f".step-00000006.pt.tmp-{os.getpid()}-00ff", "step-00000004.pt"):
        ...     _ = (folder / name).write_bytes(b"")
        >>> [p.name for p in remove_partial(folder, keep_pid=os.getpid())]
        ['.step-00000005.pt.tmp-4242', '.step-00000007.pt.tmp-4242-0123456789abcdef']
        >>> len(remove_partial(folder)), sorted(p.name for p in folder.iterdir())
        (1, ['step-00000004.pt'])
        >>> remove_partial(folder / "missing")
        []
        >>> shutil.rmtree(folder)
    """
    return remove_temporaries(folder, keep_pid, only=_PARTIAL.match)


def prune(folder: str | os.PathLike, keep: int, hold: int | None = None) -> None:
    """Delete all but the newest ``keep`` checkpoints; with ``hold``, none from the newest one at
    or before step ``hold`` on, and none at all while none is that old (a rollback that looks back
    past ``hold`` may return to any of them).

    Example::

        >>> import shutil, tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> for step in (1, 2, 3, 4, 5, 6):
        ...     _ = (folder / checkpoint_name(step)).write_bytes(b"")
        >>> prune(folder, keep=2, hold=3)
        >>> [p.name for p in list_checkpoints(folder)]
        ['step-00000003.pt', 'step-00000004.pt', 'step-00000005.pt', 'step-00000006.pt']
        >>> prune(folder, keep=1, hold=0)
        >>> len(list_checkpoints(folder))
        4
        >>> prune(folder, keep=2)
        >>> [p.name for p in list_checkpoints(folder)]
        ['step-00000005.pt', 'step-00000006.pt']
        >>> shutil.rmtree(folder)
    """
    paths = [p for p in list_checkpoints(folder) if not p.is_dir()]  # (a folder named like one is someone's: left)
    cut = max(len(paths) - keep, 0)
    if hold is not None:  # (from the newest one at or before hold on; every one while none is that old)
        cut = min(cut, max((i for i, p in enumerate(paths) if checkpoint_step(p) <= hold), default=0))
    for path in paths[:cut]:
        path.unlink(missing_ok=True)
