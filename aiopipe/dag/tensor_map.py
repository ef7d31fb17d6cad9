"""The tensor map of a task graph: the current producer of every tensor written.

A producer that succeeded leaves the map at once (its readers need not wait for it);
a failed one stays until its scope closes, so that later readers are poisoned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple

import torch

from ..errors import ConfigurationTypeError

if TYPE_CHECKING:
    from .nodes import Node

__all__ = ("TensorKey", "TensorMap")

#: (device, data address)
TensorKey = Tuple[str, int]


class TensorMap:
    """The current producer of every tensor written in the graph, keyed by the
    tensor's data address: a view shares its entry with every tensor that starts
    at the same address, and disjoint rows of one buffer are independent (views
    that overlap without sharing a start are not ordered against each other)."""

    def __init__(self) -> None:
        self._producer: dict[TensorKey, Node] = {}

    @staticmethod
    def key(value: Any) -> TensorKey:
        if not isinstance(value, torch.Tensor):
            raise ConfigurationTypeError(f"only tensors can be tagged, got {type(value).__name__}")
        return (str(value.device), value.data_ptr())

    def lookup(self, key: TensorKey) -> Node | None:
        return self._producer.get(key)

    def insert(self, key: TensorKey, node: Node) -> None:
        self._producer[key] = node
        node.writes.append(key)

    def retire(self, node: Node) -> None:
        """``node`` succeeded: its readers need not wait, drop the entries still its."""
        for key in node.writes:
            if self._producer.get(key) is node:
                del self._producer[key]

    def forget(self, nodes: set[Node]) -> None:
        self._producer = {k: n for k, n in self._producer.items() if n not in nodes}

    def __len__(self) -> int:
        return len(self._producer)
