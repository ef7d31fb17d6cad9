"""Argument tags: how a tensor argument of a submitted task takes part in ordering.

=================  ==============================  =================================
tag                looks up the current producer   becomes the tensor's producer
=================  ==============================  =================================
INPUT              yes (read after write)          no
INOUT              yes (read after write)          yes (the write replaces it)
OUTPUT             no: a pure overwrite            yes
OUTPUT_EXISTING    no: a pure overwrite            yes (the buffer is the caller's)
NO_DEP             no                              no
=================  ==============================  =================================

``OUTPUT`` and ``OUTPUT_EXISTING`` order the same way; the second says the buffer was
provided by the caller (for example from ``graph.alloc``) rather than made for the
task.  Tags are read at submit time only; the function receives the plain values.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ("INOUT", "INPUT", "NO_DEP", "OUTPUT", "OUTPUT_EXISTING", "Tag", "Tagged")


class Tag(enum.Enum):
    """How a submitted function uses a tensor argument: what it waits for and what it
    makes later readers wait for (see ``docs/dag.md``)."""

    INPUT = "input"
    OUTPUT = "output"
    INOUT = "inout"
    OUTPUT_EXISTING = "output_existing"
    NO_DEP = "no_dep"

    @property
    def reads(self) -> bool:
        return self in (Tag.INPUT, Tag.INOUT)

    @property
    def writes(self) -> bool:
        return self in (Tag.OUTPUT, Tag.INOUT, Tag.OUTPUT_EXISTING)

    def __call__(self, value: Any) -> Tagged:
        return Tagged(self, value)


@dataclass(frozen=True)
class Tagged:
    """A tensor argument with its tag: ``INPUT(x)``."""

    tag: Tag
    value: Any


INPUT = Tag.INPUT
OUTPUT = Tag.OUTPUT
INOUT = Tag.INOUT
OUTPUT_EXISTING = Tag.OUTPUT_EXISTING
NO_DEP = Tag.NO_DEP
