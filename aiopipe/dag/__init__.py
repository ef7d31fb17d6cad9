"""Dynamic task graphs: work whose shape changes per batch (per-table or per-chunk
work, serving requests), built at run time on aiopipe's loop and lanes.

See ``aiopipe.dag.graph`` for the model and ``aiopipe.dag.tags`` for the tag table.
"""

from __future__ import annotations

from .graph import GraphStatistics as GraphStatistics
from .graph import TaskGraph as TaskGraph
from .graph import TaskHandle as TaskHandle
from .tags import INOUT as INOUT
from .tags import INPUT as INPUT
from .tags import NO_DEP as NO_DEP
from .tags import OUTPUT as OUTPUT
from .tags import OUTPUT_EXISTING as OUTPUT_EXISTING
from .tags import Tag as Tag
from .tags import Tagged as Tagged

__all__ = (
    "INOUT",
    "INPUT",
    "NO_DEP",
    "OUTPUT",
    "OUTPUT_EXISTING",
    "GraphStatistics",
    "Tag",
    "Tagged",
    "TaskGraph",
    "TaskHandle",
)
