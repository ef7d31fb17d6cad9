"""The calls that hand out several results at once -- ``progress_many`` and
``drain`` -- and what a failure or a cancellation does to the results collected so
far: a cancellation gives them back to the feed, for the next call; a failure after
some of them is deferred to the next call, so they come out first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ._core.log import pipeline_log
from .driver import IterationDriver
from .errors import ConfigurationError, ConfigurationTypeError, PipelineStateError
from .feeds import Feeds

__all__ = ("check_steps", "collect_drain", "collect_steps")

#: ``next_of(more)``: the next result of the call's source, ``(False, None)`` at its
#: end; ``more`` results are asked for after it.
NextOf = Callable[[int], Awaitable[tuple[bool, Any]]]


def check_steps(steps: object) -> None:
    """Refuse a ``progress_many`` step count that is not an int >= 1."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise ConfigurationTypeError(f"steps must be an int, got {steps!r}")
    if steps < 1:
        raise ConfigurationError(f"steps must be >= 1, got {steps}")


async def collect_steps(
    next_of: NextOf, steps: int, driver: IterationDriver, feeds: Feeds,
    on_source_end: Callable[[], None],
) -> list[Any]:  # fmt: skip
    """Up to ``steps`` results; ``on_source_end()`` if the source ended before any."""
    results: list[Any] = []
    try:
        while len(results) < steps:
            feed = feeds.current
            waiting = feed is not None and bool(feed.outbox)  # steps finished before it
            failures = driver.failures
            if results and not waiting and (failures.pending or failures.broken is not None):
                break  # the next call raises the failure, or asks for reset()
            produced, result = await next_of(steps - len(results) - 1)
            if not produced:
                if not results:
                    on_source_end()
                break
            results.append(result)
        return results
    except BaseException as exc:
        if results and isinstance(exc, Exception) and not isinstance(exc, PipelineStateError):
            # The steps before it come out first; the source's own error (or refusal)
            # is raised by the next call on that source, not by a step() of another.
            feed = feeds.current
            if feed is not None and exc is feed.raised:
                feed.deferred = exc
            else:
                driver.failures.defer(exc)
            return results
        _give_back(feeds, results)
        raise


async def collect_drain(driver: IterationDriver, feeds: Feeds, pipeline: str) -> list[Any]:
    """Finish the current feed's batches in flight and return their results; the
    source is forgotten after (``SchedulablePipeline.drain``)."""
    results: list[Any] = []
    feed = feeds.current
    try:
        if feed is not None:
            if feed.in_flight:  # step() drains an empty feed before each batch: quiet
                pipeline_log.info("%s: drain, finishing %d batch(es) in flight", pipeline,
                                  feed.in_flight)  # fmt: skip
            feed.draining = True
            while True:
                if results and driver.failures.stopped(bool(feed.outbox)):
                    return results  # the failure came first; the rest need reset()
                produced, result = await driver.next_result(feed)
                if not produced:
                    break
                results.append(result)
        feeds.forget()
        return results
    except BaseException:
        _give_back(feeds, results)
        raise


def _give_back(feeds: Feeds, results: list[Any]) -> None:
    """What an interrupted call collected goes back to the feed, for the next call."""
    feed = feeds.current
    if feed is not None:
        feed.put_back(results)
