"""Scopes of a :class:`~aiopipe.dag.TaskGraph` (``graph.scope()``), each owned by the
asyncio task that opened it: tasks holding scopes open on one graph at once each
submit into their own innermost one, and leaving a scope waits for its own tasks."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

from ..errors import GraphError

if TYPE_CHECKING:
    from .graph import TaskGraph
    from .nodes import Node

__all__ = ("Scope", "innermost_scope")

#: The scopes the current asyncio task (or the code that made it) has open, innermost
#: last: each task submits into its own, whatever other tasks open meanwhile.
_OPEN_SCOPES: contextvars.ContextVar[tuple[tuple[TaskGraph, dict[Node, None]], ...]] = (
    contextvars.ContextVar("aiopipe_dag_scopes", default=())
)


def innermost_scope(graph: TaskGraph, open_scopes: list[dict[Node, None]]) -> dict[Node, None]:
    """The innermost of ``open_scopes`` that the calling asyncio task opened on
    ``graph`` and has not left; else the graph's own (tasks that opened none submit
    there)."""
    for owner, nodes in reversed(_OPEN_SCOPES.get()):
        if owner is graph and any(nodes is open_ for open_ in open_scopes):
            return nodes
    return open_scopes[0]


class Scope:
    """``async with graph.scope():`` -- leaving it waits for the tasks submitted in it."""

    def __init__(self, graph: TaskGraph) -> None:
        self._graph = graph
        self._nodes: dict[Node, None] = {}
        self._token: contextvars.Token[Any] | None = None

    async def __aenter__(self) -> TaskGraph:
        if not self._graph._scopes:
            raise GraphError("graph.scope() outside 'async with TaskGraph()'")
        self._graph._scopes.append(self._nodes)
        self._token = _OPEN_SCOPES.set((*_OPEN_SCOPES.get(), (self._graph, self._nodes)))
        return self._graph

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await self._graph._close_scope(self._nodes, raise_failures=exc_info[0] is None)
        finally:
            if self._token is not None:
                _OPEN_SCOPES.reset(self._token)
