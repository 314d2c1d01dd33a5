import sys

from .cli import entry

if __name__ == "__main__":  # `python -m ampguard`; importing this module (a doctest run) runs nothing
    sys.exit(entry())
