"""What torchrun's environment says (``WORLD_SIZE``, ``RANK``, ...), read and checked without torch:
the checks ``train`` makes before it builds anything (``--print-config`` among them) count ranks
with it. :mod:`ampguard.distributed` joins the process group it describes.
"""

from __future__ import annotations

import os

from .errors import LAUNCH_VARIABLES, InputError


def launched_by_torchrun() -> bool:
    """Whether the environment describes a world of more than one process (``WORLD_SIZE > 1``).
    A ``WORLD_SIZE`` that is no whole number, or one > 1 without the variables torchrun sets
    beside it (a leftover export, a plain run inside a scheduler's allocation), is one
    :class:`InputError` line (they were tracebacks from PyTorch's rendezvous).

    Example::

        >>> import unittest.mock
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}):
        ...     for name in LAUNCH_VARIABLES:
        ...         _ = os.environ.pop(name, None)
        ...     launched_by_torchrun()
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: WORLD_SIZE=2 but RANK is not set: launch with torchrun (it sets RANK, MASTER_ADDR, MASTER_PORT), or unset WORLD_SIZE to train in one process
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "localhost",
        ...                                            "MASTER_PORT": "99999"}):
        ...     launched_by_torchrun()
        Traceback (most recent call last):
        ...
        ampguard.errors.InputError: MASTER_PORT=99999 with WORLD_SIZE=2: expected a whole number from 0 to 65535 (torchrun sets it; unset WORLD_SIZE to train in one process)
    """
    given = os.environ.get("WORLD_SIZE", "1")
    try:
        size = int(given)
    except ValueError:
        raise InputError(f"WORLD_SIZE={given} is not a whole number (torchrun sets it; unset it to train in one "
                         "process)") from None
    if size < 1:
        raise InputError(f"WORLD_SIZE={given} is below 1 (torchrun sets it to the number of processes; unset it to "
                         "train in one process)")
    if size > 1:
        missing = next((name for name in LAUNCH_VARIABLES if name not in os.environ), None)
        if missing is not None:
            raise InputError(f"WORLD_SIZE={given} but {missing} is not set: launch with torchrun (it sets "
                             f"{', '.join(LAUNCH_VARIABLES)}), or unset WORLD_SIZE to train in one process")
        # their values too (a traceback from int() or from the rendezvous, exit 1, before)
        for name, low, high in (("RANK", 0, size - 1), ("LOCAL_RANK", 0, None), ("MASTER_PORT", 0, 65535)):
            text = os.environ.get(name)
            if text is None:  # (LOCAL_RANK may be unset)
                continue
            try:
                value = int(text)
            except ValueError:
                value = None
            if value is None or value < low or (high is not None and value > high):
                within = f"a whole number from {low} to {high}" if high is not None else f"a whole number >= {low}"
                raise InputError(f"{name}={text} with WORLD_SIZE={given}: expected {within} (torchrun sets it; "
                                 "unset WORLD_SIZE to train in one process)")
    return size > 1


def launched_world_size() -> int:
    """How many processes torchrun started (``WORLD_SIZE``, checked by :func:`launched_by_torchrun`),
    1 when it did not: what a check made before the process group is joined counts ranks against.

    Example::

        >>> import unittest.mock
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "1"}):
        ...     launched_world_size()
        1
    """
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


def launched_rank() -> int:
    """This process's ``RANK`` under torchrun (checked by :func:`launched_by_torchrun`), 0 when
    not launched so: before the process group is joined.

    Example::

        >>> import unittest.mock
        >>> with unittest.mock.patch.dict(os.environ, {"WORLD_SIZE": "1", "RANK": "3"}):
        ...     launched_rank()
        0
    """
    return int(os.environ["RANK"]) if launched_by_torchrun() else 0
