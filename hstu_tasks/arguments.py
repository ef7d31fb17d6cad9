"""argparse types for the examples' options: a value out of range, a malformed pair or
an output file that cannot be written is refused by argparse itself, with the
option's name, before anything is built, joined or trained.  Under torchrun every rank
parses the same command line: :class:`ArgumentParser` and :func:`refusal` let rank 0
alone say why it stops (each rank stops with the same status).  What depends on the
node (its device, its packages) is refused with a plain ``SystemExit``, said by every
rank: another node's rank may be the only one that fails it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = ("ArgumentParser", "at_least", "output_file", "pair", "refusal", "seconds")


def speaks_for_the_job() -> bool:
    """Whether this process says why the job stops: torchrun's rank 0, or no torchrun."""
    return os.environ.get("RANK", "0") == "0"


def refusal(message: str) -> SystemExit:
    """What to raise to stop before joining the process group: the message on rank 0,
    the same exit status (1) and nothing printed on the others."""
    return SystemExit(message if speaks_for_the_job() else 1)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's, with a bad command line said once under torchrun (by rank 0);
    every rank exits with argparse's status, 2."""

    def error(self, message: str) -> NoReturn:
        if not speaks_for_the_job():
            self.exit(2)
        super().error(message)


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer option that must be ``>= minimum``."""

    def parse(text: str) -> int:
        value = int(text)  # not a number: argparse says "invalid int value"
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


def seconds(text: str) -> float:
    """A duration option that must be above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


seconds.__name__ = "float"


def pair(text: str) -> tuple[int, int]:
    """Two whole numbers as ``A:B``."""
    first, colon, second = text.partition(":")
    if not colon or not first.isdigit() or not second.isdigit():
        raise argparse.ArgumentTypeError(f"expected two numbers as A:B, got {text!r}")
    return int(first), int(second)


def output_file(text: str) -> str:
    """A file written at the end of a run: refused now, not after the training, if
    its folder is missing or read-only or it is a folder itself."""
    target = Path(text)
    if not target.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: no folder {target.parent}")
    if target.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder")
    if not os.access(target if target.exists() else target.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text


pair.__name__ = "A:B"
output_file.__name__ = "path"
