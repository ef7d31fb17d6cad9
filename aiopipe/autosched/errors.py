"""The auto-scheduler's errors, under aiopipe's one root :class:`PipelineError`."""

from __future__ import annotations

from ..errors import PipelineError

__all__ = ("AutoschedError", "CostModelError")


class AutoschedError(PipelineError):
    """The auto-scheduler cannot do what was asked (no legal candidate, bad limits)."""


class CostModelError(AutoschedError, ValueError):
    """A cost model is malformed, or lacks the cost of a task it is asked about."""
