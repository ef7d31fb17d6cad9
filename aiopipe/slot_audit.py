"""Slots set or read against their declarations: ``SlotAudit`` checks a pipeline's
first batches for slots that no task declares, and :func:`unset_slot_note` says why
a task found a slot unset.

A task may call ``ctx.slots.set(name, ...)`` for a name it never declared in
``writes=``: nothing refuses it, and the value is there for whoever reads it after.
But only declared slots order tasks, so a reader may run first -- on another lane, at
the same time -- and whether it finds the value depends on timing.  The first few
batches retired are checked once each, and each undeclared name is warned about once,
at the start of the next call (or at shutdown): a warning made an error (``-W error``)
is then raised before that call takes anything, and loses no result.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from ._core.log import pipeline_log
from ._core.stack import user_stacklevel
from .errors import UndeclaredSlotWarning
from .plan import ExecutionPlan
from .ring import SlotStore
from .task import BATCH_SLOT, RESULT_SLOT

__all__ = ("SlotAudit", "unset_slot_note")


class SlotAudit:
    """Checks the stores of a pipeline's first ``batches`` batches as they retire."""

    __slots__ = ("_declared", "_left", "_name", "_pending", "_warned")

    def __init__(self, plan: ExecutionPlan, pipeline: str) -> None:
        # The result is read by the engine once every task of the batch has run: set
        # undeclared, it is still found (NoStepResultWarning says it was not declared).
        self._declared = {BATCH_SLOT, RESULT_SLOT}
        self._declared.update(slot.name for task in plan.order for slot in task.writes)
        self._name = pipeline
        self._warned: set[str] = set()
        self._pending: list[tuple[str, int | None]] = []  # (slot, batch) not warned about yet
        self._left = plan.max_lookahead + 2  # every task has run on a batch by then

    @property
    def done(self) -> bool:
        """Every batch to check has been, and its warnings given."""
        return self._left <= 0 and not self._pending

    def allow(self, names: Iterable[str]) -> None:
        """Slots an adapter seeds (``seed_first_batch``): set by no task."""
        self._declared.update(names)

    def check(self, store: SlotStore) -> None:
        """``store``'s batch has had every task run on it: note each name set in it
        that no task declares (once per name), for :meth:`warn`."""
        if self._left <= 0:
            return
        self._left -= 1
        for name in store:
            if name not in self._declared and name not in self._warned:
                self._warned.add(name)
                self._pending.append((name, store.batch_index))

    def warn(self, *, raising: bool = True) -> None:
        """Warn of the names :meth:`check` noted, pointing at the user's line; one a
        filter made an error leaves the others for the next time.  ``raising=False``
        (at shutdown, where an error would hide the one the caller may be leaving
        with): such a warning is logged instead."""
        while self._pending:
            name, batch = self._pending.pop(0)
            message = (
                f"{self._name}: slot {name!r} was set (on batch {batch}) but no task "
                f"declares writes=({name!r},): declare it on the task that sets it, and "
                f"reads=({name!r},) on those that read it, or a reader may run before it "
                f"is set (on another lane, at the same time)"
            )  # fmt: skip
            try:
                warnings.warn(message, UndeclaredSlotWarning, stacklevel=user_stacklevel())
            except UndeclaredSlotWarning:
                if raising:
                    raise
                pipeline_log.warning("%s", message)


def unset_slot_note(plan: ExecutionPlan, index: int, slot: str) -> str:
    """Why task ``index`` found ``slot`` unset (a note on its ``SlotNotSetError``): the
    tasks that declare it in ``writes=`` had not set it, or none declares it."""
    task = plan.order[index]
    writers = [t.name for t in plan.order if any(w.name == slot for w in t.writes)]
    if not writers:
        return (f"aiopipe: no task declares writes=({slot!r},): declare it on the task that "
                f"sets it, and reads=({slot!r},) on {task.name!r}, so that one runs first")
    who = (f"task {writers[0]!r} declares" if len(writers) == 1
           else f"tasks {', '.join(map(repr, writers))} declare")  # fmt: skip
    order = "" if any(r.name == slot for r in task.reads) else (
        f", and {task.name!r} must declare reads=({slot!r},) to run after it")
    return (f"aiopipe: {who} writes=({slot!r},) but had not set it for this batch when "
            f"{task.name!r} read it: its body must call ctx.slots.set({slot!r}, value){order}")
