"""What :mod:`aiopipe.checkpoint` keeps on disk: which names are complete
checkpoints; removing the ones that are not (or no longer) wanted, so that a crash
midway never leaves a broken checkpoint under a complete name; and whether a saved
checkpoint's tensors fit the state it is to be loaded into."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

#: ``step-00000042``: zero-padded to 8 digits, longer for steps >= 10**8.  A padded
#: name of more than 8 digits is no name ``path()`` writes, so it is no checkpoint.
_COMPLETE = re.compile(r"^step-(\d{8}|[1-9]\d{8,})$")
#: Suffixes of directories no checkpoint is read from: a save under way (or crashed),
#: and a pruned checkpoint being deleted.
PARTIAL = ".partial"
PRUNED = ".pruned"


def step_of(name: str) -> int | None:
    """The step of a complete checkpoint's directory name, ``None`` for other names."""
    match = _COMPLETE.match(name)
    return int(match.group(1)) if match else None


def remove_leftovers(directory: Path) -> None:
    """Delete what crashed saves and prunes left behind: it holds disk space (a
    failed save on a full disk would make every later one fail too)."""
    for suffix in (PARTIAL, PRUNED):
        for entry in directory.glob(f"step-*{suffix}"):
            shutil.rmtree(entry, ignore_errors=True)


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path``: renamed first, so a crash in the middle of the
    deletion leaves a name no one lists, never a complete name over missing data."""
    aside = path.with_name(f"{path.name}{PRUNED}")
    shutil.rmtree(aside, ignore_errors=True)
    try:
        os.replace(path, aside)
    except FileNotFoundError:  # already gone
        return
    fsync_directory(path.parent)  # the rename is durable before any file goes
    shutil.rmtree(aside, ignore_errors=True)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (where the platform allows)."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(handle)


def _leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(DCP key, value) of every value in ``state`` that is no dict, list or tuple (a
    sharded tensor is one): keys joined with dots as DCP flattens them."""
    if isinstance(state, dict):
        items: Iterable[tuple[Any, Any]] = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        yield prefix, state
        return
    for key, value in items:
        yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))


def _saved_somewhere(key: str, saved: dict[str, Any]) -> bool:
    """Whether the checkpoint holds ``key``: itself, inside a value DCP saved whole
    (a tuple of an optimizer's options), or flattened further than here."""
    parts = key.split(".")
    if any(".".join(parts[:end]) in saved for end in range(1, len(parts) + 1)):
        return True
    return any(name.startswith(f"{key}.") for name in saved)


def shape_mismatch(path: Path, state: dict[str, Any]) -> str | None:
    """The first tensor of ``state`` that the checkpoint lacks or whose global shape
    differs from the one saved, described; ``None`` when all match.  DCP would
    reshard silently or fail deep in its planner with a message that names no
    parameter."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as exc:  # an unreadable checkpoint: the load reports it with context
        return f"its metadata cannot be read ({exc})"
    for key, value in _leaves(state):
        if not isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            if not _saved_somewhere(key, saved):  # an option (an optimizer's ``momentum``)
                return _missing(key, saved)
            continue
        entry = saved.get(key)
        if entry is None:  # DCP: "Missing key in checkpoint state_dict", and a traceback
            return _missing(key, saved)
        shape = tuple(value.size())  # a sharded tensor's size() is its global shape
        if isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != shape:
            return f"{key!r} has global shape {tuple(entry.size)} there, {shape} here"
    return None


def _missing(key: str, saved: dict[str, Any]) -> str:
    """Why the checkpoint lacks ``key``, said as precisely as its keys allow."""
    # torch.optim keys its state by parameter number: ``<name>.state.<n>.<buffer>``
    optimizer, _, per_parameter = key.partition(".state.")
    if per_parameter[:1].isdigit() and not any(k.startswith(f"{optimizer}.state.") for k in saved):
        return (
            f"it has no {key!r}: the optimizer had no state yet when it was saved (before "
            f"its first step). Load it into an optimizer that has none either -- without "
            f"materialize_optimizer_state()"
        )
    return f"it has no {key!r} (written for another model or optimizer?)"
