"""aiopipe: an asyncio-native pipeline engine for PyTorch training and serving.

Layers, each depending only on the ones below it (docs/concepts.md maps them):

* the private core -- ``aiopipe._core``: loop waker, lane threads, ticket lock, loop
  running and platform shims, on the standard library alone;
* engine -- ``Task`` / ``DataSlot`` (task.py), ``Schedule`` (schedule.py),
  dependency analysis and validation (edges.py, validate.py), the batch ring
  (ring.py), the fire mask (mask.py), ``StreamPool`` (streams.py), taking items
  from a source (source.py), the life of an iteration (driver.py) and the public
  contract ``SchedulablePipeline`` (pipeline.py);
* executors -- ``SequentialExecutor`` and ``AsyncExecutor`` (one event loop plus
  GPU-submit lane threads, ticket-ordered collectives) in ``aiopipe.executors``,
  which lane runs a task in ``aiopipe.lanes``;
* conveniences -- ``Pipeline`` (facade.py), the blocking API (blocking.py),
  ``aiopipe.run`` (runner.py), GPU waits that never block the loop (gpu.py) and
  ``fetch_ahead``, a source that keeps several async fetches in flight (keyed.py);
* types for annotations -- ``Source`` (what ``progress`` pulls batches from: a sync
  or async iterator), ``ThreadMap`` (lanes.py) and ``AsyncPipeline`` (protocols.py: what
  every pipeline offers to async code).

The top level exports what programs use; the engine's own machinery (dependency
edges and topological order in ``aiopipe.edges``, the batch ring in ``aiopipe.ring``)
stays importable from its module.  Every error aiopipe raises is a
:class:`PipelineError` (families in ``aiopipe.errors``).

The engine imports only the standard library and torch (plus nvtx and uvloop when
installed); framework adapters such as ``hstu_tasks`` live outside it.
"""

from __future__ import annotations

from .blocking import BlockingPipeline as BlockingPipeline
from .context import TaskContext as TaskContext
from .errors import AsyncLibraryError as AsyncLibraryError
from .errors import BackPressureTimeout as BackPressureTimeout
from .errors import BadBatchError as BadBatchError
from .errors import CollectiveOrderError as CollectiveOrderError
from .errors import ConfigurationError as ConfigurationError
from .errors import ConfigurationTypeError as ConfigurationTypeError
from .errors import FetchError as FetchError
from .errors import GraphError as GraphError
from .errors import NoRunningLoopError as NoRunningLoopError
from .errors import IgnoredReturnWarning as IgnoredReturnWarning
from .errors import NoStepResultWarning as NoStepResultWarning
from .errors import SerializedAwaitWarning as SerializedAwaitWarning
from .errors import PipelineError as PipelineError
from .errors import PipelineStateError as PipelineStateError
from .errors import TaskAbortedError as TaskAbortedError
from .errors import PoisonedError as PoisonedError
from .errors import ScheduleValidationError as ScheduleValidationError
from .errors import SlotNotSetError as SlotNotSetError
from .errors import TaskDefinitionError as TaskDefinitionError
from .errors import TicketAbortedError as TicketAbortedError
from .errors import UndeclaredSlotWarning as UndeclaredSlotWarning
from .executors import AsyncExecutor as AsyncExecutor
from .executors import Executor as Executor
from .executors import SequentialExecutor as SequentialExecutor
from .protocols import AsyncPipeline as AsyncPipeline
from .facade import Pipeline as Pipeline
from .gpu import copy_to_host as copy_to_host
from .keyed import FetchAhead as FetchAhead
from .keyed import FetchStatistics as FetchStatistics
from .keyed import fetch_ahead as fetch_ahead
from .gpu import wait_for_event as wait_for_event
from .lanes import ThreadMap as ThreadMap
from .options import PipelineOptions as PipelineOptions
from .statistics import PipelineStatistics as PipelineStatistics
from .pipeline import SchedulablePipeline as SchedulablePipeline
from .presets import BasicPipeline as BasicPipeline
from .presets import basic as basic
from .presets import move_to_device as move_to_device
from .runner import run as run
from .schedule import Schedule as Schedule
from .schedule import Stage as Stage
from .sources import Source as Source
from .streams import StreamPool as StreamPool
from .task import DataSlot as DataSlot
from .task import Task as Task
from .trace import Span as Span
from .trace import Tracer as Tracer
from .validate import validate_schedule as validate_schedule

__version__ = "0.1.0"

__all__ = (
    "AsyncExecutor",
    "AsyncLibraryError",
    "AsyncPipeline",
    "BackPressureTimeout",
    "BadBatchError",
    "BasicPipeline",
    "BlockingPipeline",
    "CollectiveOrderError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "DataSlot",
    "Executor",
    "FetchAhead",
    "FetchError",
    "FetchStatistics",
    "GraphError",
    "NoRunningLoopError",
    "IgnoredReturnWarning",
    "NoStepResultWarning",
    "SerializedAwaitWarning",
    "Pipeline",
    "PipelineError",
    "PipelineOptions",
    "PipelineStateError",
    "TaskAbortedError",
    "PipelineStatistics",
    "PoisonedError",
    "SchedulablePipeline",
    "Schedule",
    "ScheduleValidationError",
    "SlotNotSetError",
    "SequentialExecutor",
    "Source",
    "Span",
    "Stage",
    "StreamPool",
    "Task",
    "TaskContext",
    "TaskDefinitionError",
    "ThreadMap",
    "TicketAbortedError",
    "UndeclaredSlotWarning",
    "Tracer",
    "basic",
    "copy_to_host",
    "fetch_ahead",
    "move_to_device",
    "run",
    "validate_schedule",
    "wait_for_event",
)
