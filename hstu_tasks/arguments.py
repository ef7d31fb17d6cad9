"""argparse types for the examples' numeric options: a value out of range is refused
by argparse itself, with the option's name, before anything is built or joined."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ("at_least", "seconds")


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
