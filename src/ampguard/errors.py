"""Errors that mean "bad input": the CLI prints them on one line and exits 2."""


class InputError(Exception):
    """Bad input from the user (usage, config, data file, checkpoint). One line, names the problem.

    Example::

        >>> try:
        ...     raise InputError("data.csv: no such file")
        ... except InputError as err:
        ...     print(f"error: {err}")
        error: data.csv: no such file
    """


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
