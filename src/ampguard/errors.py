"""Errors that mean "bad input": the CLI prints them on one line and exits 2."""


class InputError(Exception):
    """Bad input from the user (usage, config, data file, checkpoint). One line, names the problem."""


class ConfigError(InputError):
    """A config that cannot be used; the message names the key."""
