"""Hypothesis state machines: random sequences of calls against a model of what
must come out (issue #30's contract).

:class:`FeedModel` is the model of one source: each iteration first pulls one item
into the ring (a refused item raises ``BadBatchError`` there and then; the batches
in flight stay intact), runs, and applies the step of the batch ``L`` (max
lookahead) iterations older; a ``progress`` runs iterations until the oldest batch
not returned has been applied and returns its result; as an iteration starts the
next item is read ahead.  A ``drain`` reads nothing new (the item read ahead
excepted) and finishes what is in flight; the source then continues after it.
``reset()`` drops the batches in flight (counted in ``statistics().discarded``) and
the results of applied steps not yet returned, and *parks* the feed: its counts stay
in ``statistics()`` until a call passes a source, and an item it read ahead goes
first to the next feed of the same source (another source discards it, counted).

The operations: progress, drain, a new source (refused while batches are in
flight), a task body failing in an iteration that applies a step (the oldest
batch's train, or a later batch's prep/load once that step ran), reset, shutdown
and a new pipeline, checkpoint-and-resume, a ``results()`` loop left early (a new
source passed next discards its batches in flight, counted), the event loop ending
(as ``asyncio.run`` ends it) and a new one taking over, and cancellation while a
call waits at a gate: during a step, a drain, a pull (``read_ahead=False``), an
``aclose()`` or a ``wait_idle()``.  A cancelled call changes nothing the model sees:
its iteration runs on and its result is returned by the next call.

After every step each machine checks that every result comes out exactly once and
in order (each call's result is the model's; the results delivered, saved with a
checkpoint or discarded by ``reset()``/``shutdown()`` are, in order, the steps the
train body applied, none twice), and that whenever the pipeline is idle,
``statistics().applied`` is the number of steps applied from the current source and
``applied + refused`` a position a resumed run continues from; ``discarded`` is the
model's count of batches dropped untrained.

``PipelineMachine`` reads a sync source ahead; ``NoReadAheadMachine`` pulls async
sources (generators, and async iterators that are not) with ``read_ahead=False``;
``SparseDistMachine`` drives torchrec's sparse-dist pipeline, whose first call
bootstraps on the source's first item.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from torchrec.datasets.utils import Batch

from aiopipe import BadBatchError, Pipeline, PipelineStateError, Task, TaskContext
from hstu_tasks import DLRMConfig, SparseDistPipeline, SyntheticDLRMData, build_dlrm_training
from one_rank import one_rank_group

LOOKAHEAD = 2  # the machines' schedule: load (2), prep (1), train (0)
#: A new source's items, True where check_batch refuses one.
REFUSED = st.lists(st.sampled_from([False, False, False, False, True]), min_size=1, max_size=10)
GATE_TIMEOUT = 10  # seconds: a gate is opened by the next rule; only a hang reaches it


class Injected(RuntimeError):
    """The failure a rule arms in a task body."""


class Refused(Exception):
    """The model's ``BadBatchError``."""


def finish(loop: asyncio.AbstractEventLoop) -> None:
    """End ``loop`` as ``asyncio.run`` does (cancel what is left, close the async
    generators it ran, join its default executor), then close it."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.run_until_complete(loop.shutdown_default_executor())
    loop.close()


async def cancel_once_it_waits(call: asyncio.Future[Any], reached: asyncio.Event | None) -> None:
    """Cancel ``call`` once it waits at a gate (``reached`` is set), or after a loop
    cycle when what it waits for is held at one already; it raises ``CancelledError``."""
    try:
        if reached is not None:
            waiting = asyncio.ensure_future(reached.wait())
            done, _ = await asyncio.wait({waiting, call}, timeout=GATE_TIMEOUT,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            waiting.cancel()
            assert waiting in done, f"the call did not wait at the gate: {call}"
        else:
            await asyncio.sleep(0)
        assert not call.done()  # what it waits for is held: it cannot have returned
    except BaseException:
        call.cancel()  # leave no call behind a failed rule
        await asyncio.gather(call, return_exceptions=True)
        raise
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call


# -- the model ---------------------------------------------------------------------------


@dataclass
class FeedModel:
    """What one source must give a pipeline (the engine's ``Feed``), from where that
    source stood when the pipeline adopted it.  ``items`` holds its items, refused
    ones (in ``bad``) included; indices count items, ``good`` the batches."""

    items: list[int]
    bad: set[int]
    read_ahead: bool
    pulls: int = 0  # items pulled into the ring or refused
    pulled: int = 0  # batches pulled into the ring
    iterations: int = 0
    returned: int = 0
    applied: int = 0  # steps applied: those returned, then those waiting for a call
    refused: int = 0
    ahead: bool = False  # the item at ``pulls`` was read ahead (or is being pulled)
    exhausted: bool = False
    draining: bool = False
    discarded: int = 0  # batches dropped untrained (reset(), an abandoned loop)
    results_dropped: int = 0  # results of applied steps dropped with them
    ended: bool = False  # a call was handed the source's end (not only a drain reading it)
    # The counts of the same source before a drain() -- pulled, returned, applied,
    # refused, position -- which this feed counts on from; and whether the engine has
    # no feed of its own for it yet (after the drain, until a call passes the source).
    before: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    detached: bool = False
    # The source had ended: the statistics show its counts until a call passes it
    # again, which starts a new pass from 0.
    afresh_on_adopt: bool = False

    @property
    def held_ahead(self) -> bool:
        """An item of the source was read ahead (or is being pulled), not yet taken."""
        return self.ahead and self.pulls < len(self.items)

    @property
    def batch_ahead(self) -> bool:
        """:attr:`held_ahead`, and ``check_batch`` passed it: dropped, it is a batch
        discarded (a refused one counts as refused instead)."""
        return self.held_ahead and self.items[self.pulls] not in self.bad

    @property
    def good(self) -> list[int]:
        return [item for item in self.items if item not in self.bad]

    @property
    def pending(self) -> list[int]:
        """Results of applied steps that no call has returned yet."""
        return self.good[self.returned + self.results_dropped:self.applied]

    @property
    def in_flight(self) -> int:
        taken = self.pulled - self.returned - self.discarded - self.results_dropped
        return taken + self.held_ahead

    def discard(self) -> int:
        """Drop the batches in flight, untrained, and the results waiting (the engine's
        ``Feed.discard``); how many batches.  An item read ahead stays held."""
        dropped = self.pulled - self.applied - self.discarded
        self.discarded += dropped
        self.results_dropped = self.applied - self.returned
        return dropped

    @property
    def finished(self) -> bool:
        return self.exhausted and self.returned >= self.pulled

    def next_result(self) -> int | None:
        """The engine's next result; ``None`` once every batch was returned."""
        while True:
            if self.applied > self.returned:
                self.returned += 1
                return self.good[self.returned - 1]
            if not self.exhausted:
                self._pull()
            if self.finished:
                return None
            self._iterate()

    def drain(self) -> list[int]:
        self.draining = True
        results: list[int] = []
        try:
            while (result := self.next_result()) is not None:
                results.append(result)
        except Refused:
            self.returned -= len(results)  # what it collected comes first from the next call
            raise
        return results

    def run_until_applied(self, batch: int) -> None:
        """Run iterations until ``batch``'s step is applied, returning nothing: a call
        left (cancelled, failed) while that iteration ran; the results wait."""
        returned = self.returned
        while self.applied <= batch:
            self.next_result()
        self.returned = returned

    def position_range(self) -> tuple[int, int]:
        """The items a resumed run may start at: after the last applied step, not
        after the first batch not applied."""
        good_at = [n for n, item in enumerate(self.items) if item not in self.bad]
        low = good_at[self.applied - 1] + 1 if self.applied else 0
        high = good_at[self.applied] if self.applied < len(good_at) else len(self.items)
        return low, high

    def totals(self) -> tuple[int, int, int, int, int]:
        """The counts ``statistics()`` shows, those before a drain() included; the
        position exact only once drained (every item taken done with)."""
        own = (self.pulled, self.returned, self.applied, self.refused, self.pulls)
        return tuple(b + o for b, o in zip(self.before, own))  # type: ignore[return-value]

    def _pull(self) -> None:
        if self.draining and not self.ahead:
            self.exhausted, self.ahead = True, False
            return
        if self.pulls == len(self.items):
            self.exhausted = True
            self.ahead = False
            return
        item = self.items[self.pulls]
        self.pulls += 1
        self.ahead = False
        if item in self.bad:
            self.refused += 1
            raise Refused(item)
        self.pulled += 1

    def _iterate(self) -> None:
        if self.read_ahead and not (self.draining or self.exhausted):
            self.ahead = True  # read as the iteration starts, before any caller can leave
        number, self.iterations = self.iterations, self.iterations + 1
        if 0 <= number - LOOKAHEAD < self.pulled:
            self.applied = number - LOOKAHEAD + 1


# -- sources -----------------------------------------------------------------------------


class Items(Iterator[int]):
    """A sync source that counts the items it gave."""

    def __init__(self, labels: list[int]) -> None:
        self.labels, self.given = labels, 0
        self.source = self

    def __next__(self) -> int:
        if self.given == len(self.labels):
            raise StopIteration
        self.given += 1
        return self.labels[self.given - 1]


Gate = Callable[[int], Any]  # awaited before an async source gives the item


class AsyncItems:
    """An async iterator that is not a generator: a pull cancelled while it waits at
    the gate keeps its place."""

    def __init__(self, labels: list[int], gate: Gate) -> None:
        self.labels, self.given, self.gate = labels, 0, gate
        self.source = self

    def __aiter__(self) -> AsyncItems:
        return self

    async def __anext__(self) -> int:
        if self.given == len(self.labels):
            raise StopAsyncIteration
        await self.gate(self.labels[self.given])
        self.given += 1
        return self.labels[self.given - 1]


class GeneratedItems:
    """An async generator (``source``) and the count of the items it yielded; a
    cancellation thrown into it would close it.  It yields ``make(label)``."""

    def __init__(self, labels: list[int], gate: Gate, make: Callable[[int], Any] = int) -> None:
        self.labels, self.given = labels, 0
        self.source = self._items(gate, make)

    async def _items(self, gate: Gate, make: Callable[[int], Any]) -> AsyncIterator[Any]:
        for label in self.labels:
            await gate(label)
            self.given += 1
            yield make(label)


# -- the engine's machine ----------------------------------------------------------------


class PipelineMachine(RuleBasedStateMachine):
    """A three-task pipeline on two lanes, its sync source read ahead."""

    READ_AHEAD = True
    KINDS: tuple[str, ...] = ("sync",)  # the kinds of source it reads

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        # A train body whose batch is ``hold`` tells ``on_hold`` and waits at the gate,
        # which only a rule that awaits the pipeline opens: until then the iteration a
        # cancelled call left is certainly still running, whatever the threads' timing.
        self.hold: int | None = None
        self.on_hold: Callable[[], Any] = lambda: None
        self.gate = threading.Event()
        self.held = False  # an iteration waits at the gate (its caller was cancelled)
        self.pulling = False  # a pull waits at a gate (its caller was cancelled)
        # A rule arms a failure: (task, batch) raises, once the oldest batch's step ran.
        self.failing: tuple[str, int] | None = None
        self.oldest: int | None = None
        self.oldest_trained = threading.Event()
        self.failure: str | None = None  # "pending" (the next call raises it), "broken"
        self.trained: list[int] = []  # the steps applied, in order, by the train body
        self.accounted: list[int] = []  # delivered, saved with a checkpoint or discarded
        self.done_before: list[int] = []  # steps applied from the feeds before this one
        self.bad: set[int] = set()  # items check_batch refuses
        self.labels = itertools.count()
        # The feed whose statistics the pipeline shows: the previous source's, until a
        # call passes the new one; or the feed reset() parked (``parked``), the
        # pipeline then having no current feed.  The parked feed's source, and whether
        # it holds an item read ahead: a call passing another source discards it.
        self.shown: FeedModel | None = None
        self.parked = False
        self.parked_source: Any = None
        self.parked_ahead = False
        self.parked_taken_up_by_drain = False  # drain() takes the parked source up
        # The item read ahead is a pull held at its gate (or one cancelled with its
        # loop): the source has not given it, so dropping it discards nothing.
        self.unread_pull = False
        self.discarded = 0  # batches dropped untrained, since the pipeline was built
        # A results() loop over the source was left early with batches in flight: a
        # call passing another source discards them instead of being refused.
        self.abandoned = False
        self.pipe = self.new_pipeline()
        self.new_source([False] * 5, self.KINDS[0])

    def new_pipeline(self) -> Pipeline:
        return Pipeline(self.tasks(), thread_map={"load": "io", "prep": "io", "train": "compute"},
                        check_batch=self.check_batch, read_ahead=self.READ_AHEAD)  # fmt: skip

    def check_batch(self, batch: int) -> None:
        if batch in self.bad:
            raise ValueError(f"item {batch} is refused")

    def tasks(self) -> list[Task]:
        def load(ctx: TaskContext) -> None:
            self.maybe_fail("load", ctx.slots["batch_cpu"])
            ctx.slots.set("raw", ctx.slots["batch_cpu"])

        def prep(ctx: TaskContext) -> None:
            self.maybe_fail("prep", ctx.slots["raw"])
            ctx.slots.set("x", ctx.slots["raw"])

        def train(ctx: TaskContext) -> None:
            batch = ctx.slots["x"]
            if batch == self.hold:
                self.hold = None
                self.on_hold()
                assert self.gate.wait(GATE_TIMEOUT)  # a cancellation lands meanwhile
            if self.failing == ("train", batch):
                raise Injected(f"train of batch {batch}")
            self.trained.append(batch)
            if batch == self.oldest:
                self.oldest_trained.set()
            ctx.slots.set("step_result", batch)

        return [
            Task.from_fn("load", load, lookahead=2, stream="io", writes=("raw",)),
            Task.from_fn("prep", prep, lookahead=1, stream="io", reads=("raw",), writes=("x",)),
            Task.from_fn("train", train, reads=("x",), writes=("step_result",)),
        ]

    def maybe_fail(self, task: str, batch: int) -> None:
        if self.failing == (task, batch):
            # a later batch's task, in the iteration that applies the oldest batch's step
            assert self.oldest_trained.wait(GATE_TIMEOUT)
            raise Injected(f"{task} of batch {batch}")

    # -- sources -------------------------------------------------------------------------

    def make_source(self, labels: list[int], kind: str) -> Any:
        self.kind = kind
        self.counter: Items | AsyncItems | GeneratedItems = Items(labels)
        return self.counter.source

    def new_source(self, refused: list[bool], kind: str) -> None:
        labels = [next(self.labels) for _ in refused]
        self.bad |= {label for label, bad in zip(labels, refused) if bad}
        self.start_source(labels, kind)

    def start_source(self, labels: list[int], kind: str) -> None:
        source = getattr(self, "source", None)
        if inspect.isasyncgen(source) and not source.ag_running:
            self.run(source.aclose())  # left behind: close it (its loop would)
        self.source = self.make_source(labels, kind)
        self.feed = FeedModel(labels, self.bad, self.READ_AHEAD)

    def adopted(self) -> None:
        """A call passed the current source, or the pipeline forgot the previous one."""
        feed = self.feed
        feed.detached = False
        if feed.afresh_on_adopt:  # a new pass of a source that had ended
            feed.before, feed.afresh_on_adopt = (0, 0, 0, 0, 0), False
        if self.shown is not None:
            if self.parked and self.source is not self.parked_source:
                # read ahead, never taken
                self.discarded += int(self.parked_ahead and not self.unread_pull)
            self.done_before += self.shown.good[:self.shown.applied]
            self.shown = None
        self.parked = self.abandoned = False

    def next_feed(self, drained: bool = False, passed: bool = False) -> None:
        """The pipeline forgot the source (a drain, a new pipeline): a new feed starts
        where the source stands.  After a ``drain()`` it counts on from the old one's
        counts, unless the source had ended (the counts are shown until a call passes
        it again; ``passed``: this call does)."""
        self.adopted()
        old = self.feed
        self.done_before += old.good[:old.applied]
        self.feed = FeedModel(self.counter.labels[self.counter.given:], self.bad, self.READ_AHEAD)
        if drained and not (old.ended and passed):
            self.feed.before, self.feed.detached = old.totals(), not passed
            self.feed.afresh_on_adopt = old.ended

    # -- calling the pipeline ------------------------------------------------------------

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def call(self, api: str, *args: Any) -> Any:
        if args == (self.source,):
            self.adopted()

        async def call() -> Any:  # made inside the loop: coroutine APIs need one running
            return await getattr(self.pipe, api)(*args)

        return self.run(call())

    def let_go(self) -> None:
        """Let an iteration held at the gate run on (a pull held at one stays held)."""
        self.gate.set()
        self.held = False

    def open_gates(self) -> None:
        """Let go of whatever waits at a gate."""
        self.let_go()

    def wait_until_idle(self) -> None:
        """An iteration let go at the gate may still be finishing: wait for it."""
        self.let_go()
        self.run(self.pipe.wait_idle())

    def trial(self, call: str) -> tuple[FeedModel, Any]:
        """What ``call`` would do now, on a copy of the model: its result (``Refused``
        when it would refuse an item, ``None`` at the end)."""
        trial = copy.copy(self.feed)
        if call == "drain" and self.parked:
            return trial, []  # no current feed: nothing to finish
        try:
            return trial, trial.next_result() if call == "progress" else trial.drain()
        except Refused as refused:
            return trial, refused

    def next_result(self) -> int | None | Refused:
        """The model's result of one progress() on the current source (``None`` at its
        end, ``Refused`` when it refuses an item)."""
        self.adopted()
        feed = self.feed
        try:
            expected = feed.next_result()
            if expected is None and feed.draining:
                # the interrupted drain is over: the source goes on
                self.next_feed(drained=True, passed=True)
                expected = self.feed.next_result()
        except Refused as refused:
            return refused
        if expected is None:
            self.feed.ended = True  # the same source passed again after a drain(): a new pass
        return expected

    def expect_progress(self) -> None:
        """One progress() call against the model's."""
        expected = self.next_result()
        if isinstance(expected, Refused):
            with pytest.raises(BadBatchError):
                self.call("progress", self.source)
            return
        if expected is None:
            with pytest.raises(StopAsyncIteration):
                self.call("progress", self.source)
            return
        assert self.call("progress", self.source) == expected
        self.accounted.append(expected)

    def progress_call(self) -> asyncio.Future[Any]:
        """A progress() call under way, as a task (to cancel)."""
        return asyncio.ensure_future(self.pipe.progress(self.source))

    def hold_train(self, batch: int) -> asyncio.Event:
        """Make ``batch``'s train body wait at the gate; the event is set once it does.
        Called on the running loop."""
        started, loop = asyncio.Event(), asyncio.get_running_loop()
        self.gate.clear()
        self.on_hold = lambda: loop.call_soon_threadsafe(started.set)
        self.hold = batch
        return started

    # -- what the next call would do (the rules' preconditions) --------------------------

    @property
    def busy(self) -> bool:
        """Anything in flight, or to report: else a drain or a restart changes nothing."""
        feed = self.feed
        return bool(self.failure or self.held or self.pulling or feed.in_flight or feed.draining)

    @property
    def quiet(self) -> bool:
        """Not broken, and nothing waits at a gate."""
        return self.failure is None and not self.held and not self.pulling

    def step_of_next_progress(self) -> int | None:
        """The batch whose step the next progress applies and returns."""
        trial, result = self.trial("progress")
        return result if isinstance(result, int) and not self.feed.pending else None

    def steps_of_next_drain(self) -> list[int]:
        """The batches whose steps the next drain applies."""
        _, results = self.trial("drain")
        return results[len(self.feed.pending):] if isinstance(results, list) else []

    def tasks_that_can_fail(self, call: str) -> list[str]:
        """The tasks of the next iteration that applies a step in ``call`` (the oldest
        batch's train; prep and load of the next two batches, if pulled)."""
        feed = self.feed
        trial, result = self.trial(call)
        if (call == "progress" and feed.pending) or isinstance(result, Refused) or (
            trial.applied <= feed.applied
        ):
            return []
        return ["train", "prep", "load"][:trial.pulled - feed.applied]

    # -- rules ---------------------------------------------------------------------------

    @initialize(kind=st.integers(0, 1), calls=st.integers(0, 3))
    def start(self, kind: int, calls: int) -> None:
        if kind % len(self.KINDS):
            self.new_source([False] * 5, self.KINDS[kind % len(self.KINDS)])
        self.progress(calls)

    @rule(calls=st.integers(1, 3))
    def progress(self, calls: int) -> None:
        for _ in range(calls):
            self.one_progress()

    def one_progress(self) -> None:
        self.open_gates()  # an interrupted iteration finishes first
        if self.failure == "pending":
            with pytest.raises(Injected):
                self.call("progress", self.source)
            self.failure = "broken"
        elif self.failure == "broken" and not self.feed.pending:
            with pytest.raises(PipelineStateError, match=r"reset\(\)"):
                self.call("progress", self.source)
        else:
            self.expect_progress()  # after a failure: the results of applied steps first

    @precondition(lambda self: self.busy)
    @rule()
    def drain(self) -> None:
        self.open_gates()
        taken_up = self.parked and self.parked_taken_up_by_drain
        if self.parked and not taken_up:  # reset() left no current feed to drain
            assert self.call("drain") == []
            return
        if taken_up:  # the source reset() parked, with the item it kept, as if passed
            self.adopted()
        feed = self.feed
        if self.failure == "pending":
            with pytest.raises(Injected):
                self.call("drain")
            self.failure = "broken"
        elif self.failure == "broken":
            if not feed.pending:
                with pytest.raises(PipelineStateError, match=r"reset\(\)"):
                    self.call("drain")
                return
            assert self.call("drain") == feed.pending  # the source is kept, for reset()
            self.accounted += feed.pending
            feed.returned = feed.applied
        else:
            if feed.in_flight and not self.abandoned and not taken_up:
                # another source is refused, and nothing taken from it
                candidate = iter([-1])
                with pytest.raises(PipelineStateError, match="in flight"):
                    self.call("progress", candidate)
                assert next(candidate) == -1
            try:
                expected = feed.drain()
            except Refused:
                with pytest.raises(BadBatchError):
                    self.call("drain")
                return
            assert self.call("drain") == expected
            self.accounted += expected
            self.next_feed(drained=True)

    @precondition(lambda self: not self.busy or self.parked)
    @rule(refused=REFUSED, kind=st.integers(0, 1))
    def switch_source(self, refused: list[bool], kind: int) -> None:
        """Nothing in flight, or only an item that reset() kept: the next call passes
        a new source (and discards that item)."""
        if self.shown is None:
            self.shown = self.feed  # shown until a call passes the new source
        # A pull held at its gate is the parked feed's: the call passing the new
        # source cancels it.
        self.pulling = False
        self.new_source(refused, self.KINDS[kind % len(self.KINDS)])

    def cancellations(self) -> list[str]:
        """Where a call can be cancelled now (each waits at a gate there)."""
        ways = []
        if self.quiet and self.step_of_next_progress() is not None:
            ways.append("step")
        if self.quiet and self.steps_of_next_drain():
            ways.append("drain")
        if self.held:
            ways += ["aclose", "wait_idle"]
        return ways

    @precondition(lambda self: self.cancellations())
    @rule(where=st.sampled_from(["step", "drain", "pull", "aclose", "wait_idle"]),
          which=st.integers(0, LOOKAHEAD + 1))  # fmt: skip
    def cancel(self, where: str, which: int) -> None:
        """Cancel a call while it waits at a gate: ``where`` if it can be done now, else
        the first way that can (noted)."""
        ways = self.cancellations()
        if where not in ways:
            where = ways[0]
            note(f"cancel: {where} instead")
        if where == "step":
            self.cancel_during_a_step()
        elif where == "drain":
            self.cancel_a_drain(which)
        elif where == "pull":
            self.cancel_a_pull(1 + which % 2)
        else:
            self.cancel_while_waiting_idle(where)

    def cancel_during_a_step(self) -> None:
        """A progress cancelled while its iteration applies the oldest batch's step."""
        batch = self.step_of_next_progress()
        assert batch is not None
        self.adopted()

        async def cancel() -> None:
            started = self.hold_train(batch)
            await cancel_once_it_waits(self.progress_call(), started)

        self.run(cancel())
        self.feed.run_until_applied(self.feed.applied)  # its result waits for the next call
        self.held = True

    def cancel_a_drain(self, which: int) -> None:
        """A drain cancelled while one of the steps it applies runs: what it collected
        before comes first from the next call."""
        steps = self.steps_of_next_drain()
        batch = steps[which % len(steps)]
        applied = self.feed.applied

        async def cancel() -> None:
            started = self.hold_train(batch)
            await cancel_once_it_waits(asyncio.ensure_future(self.pipe.drain()), started)

        self.run(cancel())
        self.feed.draining = True
        self.feed.run_until_applied(applied + steps.index(batch))
        self.held = True

    def cancel_a_pull(self, calls: int) -> None:
        raise NotImplementedError  # sources read ahead are sync: next() cannot be interrupted

    def cancel_while_waiting_idle(self, api: str) -> None:
        """``aclose()``/``wait_idle()`` cancelled while they wait for an iteration
        held at the gate: they raise at once and leave the pipeline open."""

        async def cancel() -> None:
            await cancel_once_it_waits(asyncio.ensure_future(getattr(self.pipe, api)()), None)

        self.run(cancel())
        assert not self.pipe.statistics().closed  # left open, its iteration running
        assert not self.pipe.idle

    @precondition(lambda self: self.failure is None)
    @rule(take=st.integers(1, LOOKAHEAD + 2), leave=st.sampled_from(["break", "aclose"]),
          then=st.one_of(st.none(), REFUSED), kind=st.integers(0, 1))  # fmt: skip
    def results_loop(self, take: int, leave: str, then: list[bool] | None, kind: int) -> None:
        """``async for`` over ``results(source)``, left after ``take`` results (by
        ``break``, the iterator then dropped, or by ``aclose()``) unless the source
        ends or refuses an item first.  Left at a result with batches in flight, the
        loop abandons the source: then (``then``), a call passing a new source
        discards those batches and an item read ahead, counted in ``discarded``; not
        left at a result (a refused item), the new source is refused."""
        self.open_gates()  # an interrupted iteration finishes first
        expected: list[int | str] = []
        while len(expected) < take:
            result = self.next_result()
            if result is None:
                break
            expected.append("refused" if isinstance(result, Refused) else result)
            if isinstance(result, Refused):
                break

        async def loop() -> list[int | str]:
            got: list[int | str] = []
            results = self.pipe.results(self.source)
            try:
                async for result in results:
                    got.append(result)
                    if len(got) == take:
                        break
            except BadBatchError:
                got.append("refused")
            if leave == "aclose":
                await results.aclose()
            del results  # (break: the iterator, dropped, tells the pipeline at once)
            return got

        assert self.run(loop()) == expected
        self.accounted += [result for result in expected if isinstance(result, int)]
        feed = self.feed
        self.abandoned = len(expected) == take and expected[-1] != "refused" and bool(
            feed.in_flight
        )  # fmt: skip
        if then is None:
            return
        if feed.in_flight and not self.abandoned:
            candidate = iter([-1])
            with pytest.raises(PipelineStateError, match="in flight"):
                self.call("progress", candidate)
            assert next(candidate) == -1  # nothing taken from it
            return
        self.wait_until_idle()  # a new source replaces an abandoned one only when idle
        if self.abandoned and feed.pending:
            # Results of steps applied (by a cancelled drain) but not returned are owed
            # to the caller: another source is refused until drain() or reset().
            candidate = iter([-1])
            with pytest.raises(PipelineStateError, match="wait to be returned"):
                self.call("progress", candidate)
            assert next(candidate) == -1  # nothing taken from it
            return
        if self.abandoned:
            self.discarded += feed.discard() + int(feed.batch_ahead)
        self.shown = self.feed
        self.new_source(then, self.KINDS[kind % len(self.KINDS)])
        self.one_progress()

    @precondition(lambda self: self.held or self.feed.pending)
    @rule()
    def wait_idle(self) -> None:
        self.open_gates()
        self.run(self.pipe.wait_idle())
        assert self.pipe.idle

    @precondition(lambda self: self.quiet and (
        self.tasks_that_can_fail("progress") or self.tasks_that_can_fail("drain")))  # fmt: skip
    @rule(call=st.sampled_from(["progress", "drain"]), which=st.integers(0, 2))
    def fail(self, call: str, which: int) -> None:
        """In the next iteration of ``call`` (or of the other call, if it has none,
        noted) that applies a step, the train body of the oldest batch, or the prep
        or load body of a later batch once that step ran, raises."""
        tasks = self.tasks_that_can_fail(call)
        if not tasks:
            call = "drain" if call == "progress" else "progress"
            note(f"fail: in a {call} instead")
            tasks = self.tasks_that_can_fail(call)
        task = tasks[which % len(tasks)]
        feed = self.feed
        applied = feed.applied
        self.oldest, self.oldest_trained = feed.good[applied], threading.Event()
        self.failing = (task, feed.good[applied + tasks.index(task)])
        kept = task != "train"  # every task of the oldest batch ran: its result is kept
        try:
            if call == "progress" and kept:
                assert self.call("progress", self.source) == self.oldest
                self.accounted.append(self.oldest)
                self.failure = "pending"  # the next call raises it
            else:
                with pytest.raises(Injected):
                    self.call("drain") if call == "drain" else self.call("progress", self.source)
                self.failure = "broken"  # a drain leaves what it collected, in front
        finally:
            self.failing = None
        feed.draining = feed.draining or call == "drain"
        feed.run_until_applied(applied)  # the iterations up to the failed one ran
        feed.applied = applied + kept
        if self.failure == "pending":
            feed.returned = applied + 1

    @precondition(lambda self: self.busy)
    @rule(how=st.sampled_from(["reset", "shutdown"]))
    def start_again(self, how: str) -> None:
        """Reset, or shut down and go on in a new pipeline."""
        if how == "reset":
            self.reset()
        else:
            self.shutdown_and_start_again()

    def reset(self) -> None:
        if self.held:
            with pytest.raises(PipelineStateError, match="still running"):
                self.pipe.reset()
            return
        self.wait_until_idle()  # an iteration let go may be finishing
        self.pipe.reset()
        self.after_reset()

    def after_reset(self) -> None:
        """The batches in flight are dropped, counted (the results waiting too, while
        ``applied`` still counts them), and the feed parked: ``statistics()`` shows it
        until a call passes a source.  Passed again, the source goes on with the item
        read ahead, if any, then after what it gave."""
        abandoned = self.abandoned
        self.failure, self.abandoned = None, False
        if self.parked:
            return  # no current feed: nothing to drop
        # drain() takes the parked source up again, unless it had ended, or a results()
        # loop over it was left early (nothing more trained).
        self.parked_taken_up_by_drain = not abandoned and not (
            self.feed.exhausted and self.feed.returned >= self.feed.pulled)  # fmt: skip
        if self.shown is not None:  # the current feed is the last source's, idle
            self.parked, self.parked_source, self.parked_ahead = True, None, False
            self.parked_taken_up_by_drain = False
            return
        feed = self.feed
        self.accounted += feed.pending
        self.discarded += feed.discard()
        self.shown, self.parked = feed, True
        self.parked_source, self.parked_ahead = self.source, feed.batch_ahead
        self.feed = FeedModel(feed.items[feed.pulls:], self.bad, self.READ_AHEAD,
                              ahead=feed.held_ahead)  # fmt: skip
        if feed.detached:  # drained: the engine had no feed to drop, its counts go on
            self.feed.before, self.feed.detached = feed.before, True
            self.feed.afresh_on_adopt = feed.afresh_on_adopt
        elif not feed.ended:  # passed again, it counts on, past the batches dropped
            self.feed.before = feed.totals()

    def after_shutdown(self) -> None:
        """A new pipeline goes on with the source after what it gave: the batches in
        flight, the results waiting and an item read ahead are lost with the old one."""
        self.accounted += self.feed.pending
        self.failure = None
        self.next_feed()
        self.discarded = 0

    @precondition(lambda self: self.busy and self.failure is None and not self.pulling)
    @rule()
    def checkpoint_and_resume(self) -> None:
        """Save the position at a call boundary (after ``wait_idle``), then resume it
        in a new pipeline on a new source starting there."""
        self.open_gates()
        self.run(self.pipe.wait_idle())
        stats, feed = self.pipe.statistics(), self.shown or self.feed
        position = stats.position - feed.before[4]  # the position in this feed's items
        low, high = feed.position_range()
        assert low <= position <= high
        if self.shown is not None and not (self.parked and self.source is self.parked_source):
            self.adopted()  # no call has passed the new source: it starts afresh
            feed, position = self.feed, 0
        # (Parked by reset(): the position counts in the parked feed, and the resumed run
        # reads again the batches reset() discarded and the item it kept.)
        self.accounted += feed.pending  # applied, so saved with the checkpoint
        self.run(self.pipe.aclose())
        self.pipe = self.new_pipeline()
        self.done_before += feed.good[:feed.applied]
        self.shown, self.parked, self.abandoned, self.discarded = None, False, False, 0
        self.start_source(feed.items[position:], self.kind)

    def loop_can_end(self) -> bool:
        """Worth trying: the pipeline holds something across the loops."""
        return bool(self.feed.in_flight or self.pulling)

    @precondition(lambda self: self.loop_can_end())
    @rule()
    def next_event_loop(self) -> None:
        """The loop ends as ``asyncio.run`` ends it; the pipeline goes on in a new one."""
        self.wait_until_idle()
        finish(self.loop)  # a pull waiting at a gate is cancelled with its loop,
        self.loop = asyncio.new_event_loop()
        if self.pulling:
            self.pull_cancelled = True
        self.pulling = False  # and pulled again (without waiting) by the next call

    def shutdown_and_start_again(self) -> None:
        """Shut down (``aclose`` waits for an iteration held), then go on with the same
        source in a new pipeline."""
        if self.held:
            with pytest.raises(PipelineStateError, match="still running"):
                self.pipe.shutdown()
        self.let_go()
        self.run(self.pipe.aclose())
        assert self.pipe.statistics().closed
        with pytest.raises(PipelineStateError, match="shut down"):
            self.call("progress", self.source)
        self.pipe.shutdown()  # idempotent, as aclose is
        self.run(self.pipe.aclose())
        self.pipe = self.new_pipeline()
        self.after_shutdown()

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def each_step_once_and_accounted_for_in_order(self) -> None:
        assert len(set(self.trained)) == len(self.trained)
        assert self.accounted == self.trained[:len(self.accounted)]

    @invariant()
    def statistics_agree(self) -> None:
        stats = self.pipe.statistics()
        feed = self.shown or self.feed
        assert not stats.closed
        assert (stats.broken is None) == (self.failure is None)  # a cancellation never breaks it
        # an iteration runs on only while held, or finishing one whose result waits
        assert self.pipe.idle or self.held or feed.pending
        if self.held:
            assert not self.pipe.idle
        pulled, returned, applied, refused, position = feed.before  # before a drain()
        assert (stats.returned, stats.pulled, stats.refused) == (
            returned + feed.returned, pulled + feed.pulled, refused + feed.refused)
        assert stats.in_flight == feed.in_flight
        assert stats.discarded == self.discarded
        if self.pipe.idle:
            assert stats.applied == applied + feed.applied
            assert self.trained == self.done_before + feed.good[:feed.applied]
            assert len(self.trained) - len(self.accounted) == len(feed.pending)
            low, high = feed.position_range()
            assert low <= stats.position - position <= high

    def teardown(self) -> None:
        self.open_gates()
        try:
            self.run(self.pipe.aclose())
        finally:
            finish(self.loop)


class NoReadAheadMachine(PipelineMachine):
    """``read_ahead=False`` on async sources: generators, and async iterators that
    are not (only those survive their event loop's end mid-pull).  A pull can be
    held at a gate, and its caller cancelled there."""

    READ_AHEAD = False
    KINDS = ("generator", "iterator")

    def __init__(self) -> None:
        self.pull_hold: int | None = None
        self.pull_reached: asyncio.Event | None = None
        self.pull_release: asyncio.Event | None = None
        self.pull_cancelled = False  # the pull held at its gate ended with its loop
        super().__init__()

    def make_source(self, labels: list[int], kind: str) -> Any:
        self.kind = kind
        kind_of = AsyncItems if kind == "iterator" else GeneratedItems
        self.counter = kind_of(labels, self.pull_gate)
        return self.counter.source

    async def pull_gate(self, label: int) -> None:
        if label == self.pull_hold:
            assert self.pull_reached is not None and self.pull_release is not None
            self.pull_hold = None  # a pull cancelled here is pulled again without waiting
            self.pull_reached.set()
            await self.pull_release.wait()

    def open_gates(self) -> None:
        self.let_go()
        if self.pull_release is not None:
            self.pull_release.set()
        self.pulling = False
        if not self.pull_cancelled:
            self.unread_pull = False  # the source gives the item it was held at

    def next_call_pulls(self) -> bool:
        """Whether the next progress starts by pulling an item from the source."""
        feed = self.feed
        return not (feed.pending or feed.draining or feed.exhausted or feed.ahead
                    or feed.pulls == len(feed.items))  # fmt: skip

    def cancellations(self) -> list[str]:
        pull = ["pull"] if self.quiet and self.next_call_pulls() else []
        return pull + super().cancellations()

    def cancel_a_pull(self, calls: int) -> None:
        """A progress cancelled while it pulls the source; then, maybe, the next one
        too, while it waits for that same pull."""
        feed = self.feed
        self.adopted()

        async def cancel() -> None:
            reached, self.pull_release = asyncio.Event(), asyncio.Event()
            self.pull_reached, self.pull_hold = reached, feed.items[feed.pulls]
            await cancel_once_it_waits(self.progress_call(), reached)
            for _ in range(calls - 1):
                await cancel_once_it_waits(self.progress_call(), None)

        self.run(cancel())
        feed.ahead = self.pulling = True  # the item is kept for the next call
        self.unread_pull, self.pull_cancelled = True, False

    def after_shutdown(self) -> None:
        if self.pulling and self.kind == "generator":
            # shutdown() cancels the pull under way, and the generator with it: the new
            # pipeline would read it as ended.  Its remaining items are gone; drop it.
            # (reset() parks the pull instead: the next call on the source takes its item.)
            self.accounted += self.feed.pending
            self.failure = None
            self.adopted()
            self.done_before += self.feed.good[:self.feed.applied]
            self.start_source([], "iterator")
            self.discarded = 0
        else:
            super().after_shutdown()  # an iterator keeps its place
        self.pulling = False

    def loop_can_end(self) -> bool:
        # The loop's end closes the async generators it ran: one with items left is lost,
        # and one that gave its last item but has not ended can no longer be read (the
        # next call says so, tests/test_read_ahead.py): here only one seen to end.
        counter = self.counter
        return super().loop_can_end() and (
            self.kind != "generator"
            or (counter.given == len(counter.labels) and self.feed.exhausted)
        )  # fmt: skip


# Functions, not the machines' TestCase classes: pytest-repeat (./dev test --stress)
# repeats functions only.
def test_pipeline_state_machine() -> None:
    run_state_machine_as_test(PipelineMachine, settings=settings(
        max_examples=150, stateful_step_count=30, deadline=None))  # fmt: skip


def test_no_read_ahead_state_machine() -> None:
    run_state_machine_as_test(NoReadAheadMachine, settings=settings(
        max_examples=150, stateful_step_count=30, deadline=None))  # fmt: skip


# -- the sparse-dist pipeline's machine -------------------------------------------------


class SparseDistMachine(RuleBasedStateMachine):
    """torchrec's sparse-dist pipeline on one gloo rank: its engine is built by the
    first ``progress``, whose bootstrap pulls the source's first item (an async
    generator here) to trace the model on it.  Each example builds a pipeline on the
    model the test built once."""

    setup: Any = None  # the DLRM training set-up, on the test's one-rank group
    pool: list[Batch] = []  # batches to copy: each carries its label in a dense feature

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.hold: int | None = None  # as in PipelineMachine, in the forward
        self.on_hold: Callable[[], Any] = lambda: None
        self.gate = threading.Event()
        self.pull_hold: int | None = None  # a pull of this item waits at the pull gate
        self.pull_reached, self.pull_release = asyncio.Event(), asyncio.Event()
        self.held = self.pulling = False
        self.first_pulled = False  # the bootstrap's pull was let go: it holds the item
        self.trained: list[int] = []
        self.accounted: list[int] = []
        self.done_before: list[int] = []
        self.labels = itertools.count()
        setup = self.setup
        self.pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                       custom_model_fwd=self.forward)  # fmt: skip
        self.new_source(3)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, int]:
        label = int(batch.dense_features[0, 0])
        if label == self.hold:
            self.hold = None
            self.on_hold()
            assert self.gate.wait(GATE_TIMEOUT)
        self.trained.append(label)
        loss, _ = self.setup.model(batch)
        return loss, label

    def batch_for(self, label: int) -> Batch:
        batch = self.pool[label % len(self.pool)]
        dense = batch.dense_features.clone()
        dense[0, 0] = label
        return Batch(dense_features=dense, sparse_features=batch.sparse_features,
                     labels=batch.labels)  # fmt: skip

    async def pull_gate(self, label: int) -> None:
        if label == self.pull_hold:
            self.pull_hold = None
            self.pull_reached.set()
            await self.pull_release.wait()

    def new_source(self, length: int) -> None:
        source = getattr(self, "source", None)
        if source is not None and not source.ag_running:
            self.run(source.aclose())
        self.counter = GeneratedItems([next(self.labels) for _ in range(length)], self.pull_gate,
                                      self.batch_for)  # fmt: skip
        self.source = self.counter.source
        self.next = 0  # the index of the next result
        self.feed_start = 0  # where the engine's feed of this source started
        self.ended = False  # progress() reported the end of this source
        self.done_before = list(self.trained)
        # After a drain(): the steps and the index the next feed starts from, if the
        # engine starts the source afresh (it counts on unless the source had ended).
        self.drained_at: tuple[list[int], int] | None = None
        self.passed = False  # a call passed this source (else the engine shows the last one)

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def call(self, api: str, *args: Any) -> Any:
        self.passed = True

        async def call() -> Any:
            return await getattr(self.pipe, api)(*args)

        return self.run(call())

    def open_gates(self) -> None:
        self.gate.set()
        self.pull_release.set()
        self.held = self.pulling = False

    @property
    def waiting(self) -> int:
        """Results of applied steps no call has returned yet."""
        return len(self.trained) - len(self.accounted)

    def forgot_feed(self) -> None:
        """The engine forgot the source's feed: the next one starts where it stands."""
        assert self.trained == self.accounted  # every applied step's result came out
        self.done_before, self.feed_start = list(self.trained), self.next
        self.drained_at = None

    # -- rules ---------------------------------------------------------------------------

    @rule()
    def progress(self) -> None:
        self.open_gates()
        labels = self.counter.labels
        if self.next == len(labels):
            if self.ended:  # passed again: the source's feed is drained, read afresh
                self.forgot_feed()
            with pytest.raises(StopAsyncIteration):
                self.call("progress", self.source)
            self.ended = True
            return
        assert self.call("progress", self.source) == labels[self.next]
        self.accounted.append(labels[self.next])
        self.next += 1
        self.first_pulled = False

    def bootstrap_pulls(self) -> bool:
        """Whether the next progress waits for its bootstrap's pull of an item."""
        counter = self.counter
        return self.pipe.engine is None and not self.held and not self.first_pulled and (
            self.pulling or counter.given < len(counter.labels)
        )  # fmt: skip

    @precondition(lambda self: self.bootstrap_pulls())
    @rule()
    def cancel_the_bootstrap_pull(self) -> None:
        """The first progress cancelled while its bootstrap pulls the source's first
        item (again, if a cancelled call's pull waits already)."""
        counter, self.passed = self.counter, True

        async def cancel() -> None:
            reached = None
            if not self.pulling:
                reached, self.pull_release = asyncio.Event(), asyncio.Event()
                self.pull_reached, self.pull_hold = reached, counter.labels[counter.given]
            await cancel_once_it_waits(asyncio.ensure_future(self.pipe.progress(self.source)),
                                       reached)  # fmt: skip

        self.run(cancel())
        assert self.pipe.engine is None
        self.pulling = True  # the item is kept for the next call

    @precondition(lambda self: not (self.held or self.pulling or self.waiting)
                  and self.next < len(self.counter.labels))  # fmt: skip
    @rule()
    def cancel_during_a_step(self) -> None:
        """A progress cancelled while its step (the next batch's) runs."""
        batch, self.passed = self.counter.labels[self.next], True

        async def cancel() -> None:
            started, loop = asyncio.Event(), asyncio.get_running_loop()
            self.gate.clear()
            self.on_hold = lambda: loop.call_soon_threadsafe(started.set)
            self.hold = batch
            await cancel_once_it_waits(asyncio.ensure_future(self.pipe.progress(self.source)),
                                       started)  # fmt: skip

        self.run(cancel())
        self.held = True

    @rule()
    def drain(self) -> None:
        built, pulling = self.pipe.engine is not None, self.pulling
        self.open_gates()
        drained = self.call("drain")
        if not built:
            assert drained == []  # nothing in flight before the bootstrap
            self.first_pulled |= pulling  # its pull, let go, has run meanwhile
            return
        labels = self.counter.labels
        assert drained == labels[self.next:self.next + len(drained)]
        self.accounted += drained
        self.next += len(drained)
        assert self.counter.given == self.next  # every batch taken came out
        assert self.trained == self.accounted  # every applied step's result came out
        # statistics() shows the drained feed until a call passes the source again.
        self.drained_at, self.passed = (list(self.trained), self.next), False

    @rule()
    def reset(self) -> None:
        if self.held:  # refused while a cancelled step runs: nothing changes
            with pytest.raises(PipelineStateError, match="still running"):
                self.pipe.reset()
            return
        self.pipe.reset()
        self.accounted += self.trained[len(self.accounted):]  # discarded with the batches
        if self.pulling:  # the bootstrap's pull is cancelled, and the generator with it
            self.pulling = False
            self.new_source(3)
            return
        self.first_pulled = False
        self.next = self.counter.given  # the source goes on after what it gave
        self.ended = False
        self.forgot_feed()

    @precondition(lambda self: not (self.held or self.pulling or self.waiting)
                  and self.counter.given == self.next)  # fmt: skip
    @rule(length=st.integers(0, 5))
    def switch_source(self, length: int) -> None:
        """Nothing in flight: the next call takes a new source."""
        self.new_source(length)

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def each_step_once_and_in_order(self) -> None:
        assert len(set(self.trained)) == len(self.trained)
        assert self.accounted == self.trained[:len(self.accounted)]

    @invariant()
    def position_is_the_steps_applied(self) -> None:
        engine = self.pipe.engine
        if self.held:
            assert engine is not None and not engine.idle
        if engine is None or not engine.idle or not self.passed:
            return
        stats = engine.statistics()
        assert stats.discarded == 0  # reset() tears the engine down; nothing abandons a source
        if self.drained_at is not None:
            # A call passed the source after a drain(): the engine counts on (the
            # source had not ended: tests/test_stateful.py's PipelineMachine checks
            # which), or afresh; the steps since the drain tell which.
            trained_then, next_then = self.drained_at
            self.drained_at = None
            since = len(self.trained) - len(trained_then)
            if stats.applied + stats.refused == since != len(self.trained) - len(self.done_before):
                self.done_before, self.feed_start = trained_then, next_then
        steps = self.trained[len(self.done_before):]  # applied from this feed
        assert stats.applied + stats.refused == len(steps)
        assert steps == self.counter.labels[self.feed_start:self.feed_start + len(steps)]
        assert self.feed_start + stats.applied == self.next + self.waiting

    def teardown(self) -> None:
        self.open_gates()
        try:
            self.run(self.pipe.aclose())
        finally:
            finish(self.loop)


def test_sparse_dist_state_machine() -> None:
    config = DLRMConfig(num_embeddings=200, batch_size=8)
    with one_rank_group():
        SparseDistMachine.setup = build_dlrm_training(config, "sgd", seed=3)
        SparseDistMachine.pool = list(SyntheticDLRMData(config, 4))
        try:
            run_state_machine_as_test(SparseDistMachine, settings=settings(
                max_examples=15, stateful_step_count=12, deadline=None))  # fmt: skip
        finally:
            SparseDistMachine.setup, SparseDistMachine.pool = None, []
