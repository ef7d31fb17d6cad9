"""One model's torchrec rewrite, shared by every sparse-dist pipeline on that model.

torchrec's ``_rewrite_model`` replaces the forwards of a model's sharded modules with
pipelined ones that read the input distribution from a per-batch context.  A model
can be rewritten once: a training and an evaluation pipeline on the same model must
share the rewrite (and the streams it was bound to), or the second would wrap the
first one's pipelined forwards.  ``PipelinedModel.of(model, device)`` returns the one
shared object per model; ``PipelinedModel(model, device, owner=...)`` is one a
pipeline keeps to itself (the HSTU pipeline: its prefetch variant installs other
forwards).  Either way a model holds one rewrite at a time: another is refused until
the pipelines on the first give the model back.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards,
    _pipeline_detach_model,
    _rewrite_model,
    _start_data_dist,
)
from torchrec.distributed.types import ShardedModule

from aiopipe import PipelineStateError, SchedulablePipeline, StreamPool

__all__ = ("STREAMS", "PipelinedModel", "stream_pool")

#: torchrec's streams (the prefetch one for the HSTU pipeline's prefetch variant).
STREAMS = ("default", "memcpy", "data_dist", "prefetch")


def stream_pool(device: torch.device) -> StreamPool:
    """Null streams on CPU; on a GPU the current stream and torchrec's side streams
    (high priority for the copy and the input distribution, as torchrec makes them)."""
    if device.type != "cuda":
        return StreamPool({name: None for name in STREAMS})
    return StreamPool({
        "default": torch.cuda.current_stream(device),
        "memcpy": torch.cuda.Stream(device=device, priority=-1),  # type: ignore[no-untyped-call]
        "data_dist": torch.cuda.Stream(device=device, priority=-1),  # type: ignore[no-untyped-call]
        "prefetch": torch.cuda.Stream(device=device),  # type: ignore[no-untyped-call]
    })  # fmt: skip

_SHARED: weakref.WeakValueDictionary[int, PipelinedModel] = weakref.WeakValueDictionary()
#: The rewrite installed on each model (a second one would wrap its forwards).
_INSTALLED: weakref.WeakValueDictionary[int, PipelinedModel] = weakref.WeakValueDictionary()


class PipelinedModel:
    """The model, its streams, and its rewrite once the first batch has traced it;
    ``owner`` names the pipelines on it, for the message that refuses another rewrite."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *,
                 owner: str = "a sparse-dist pipeline") -> None:  # fmt: skip
        self.model = model
        self.owner = owner
        self.device = device
        self.pool: StreamPool = stream_pool(device)
        self.streams: dict[str, Any] = {name: self.pool.get(name) for name in STREAMS}
        #: The sharded modules with pipelined forwards (a list the tasks share).
        self.modules: list[Any] = []
        self.rewritten = False
        self.attached = True
        #: The pipeline whose progress() is running (they take turns).
        self.busy: Any = None
        #: The engine of each pipeline on this model (once built).
        self.engines: weakref.WeakKeyDictionary[Any, SchedulablePipeline] = (
            weakref.WeakKeyDictionary()
        )
        self._original_forwards: list[Any] = []
        self._original_kjt_dist_forwards: list[Any] = []

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device) -> PipelinedModel:
        shared = _SHARED.get(id(model))
        if shared is None or shared.model is not model:
            shared = _SHARED[id(model)] = cls(model, device)
        elif shared.device != device:
            raise ValueError(f"the model already runs in a pipeline on {shared.device}; "
                             f"every pipeline on one model must use that device, got {device}")  # fmt: skip
        return shared

    def replace_model(self, model: torch.nn.Module) -> None:
        """``attach(model)``: the pipelines go on with another model."""
        shared = _SHARED.get(id(self.model)) is self
        if shared:
            other = _SHARED.get(id(model))
            if other is not None and other is not self and other.model is model:
                raise PipelineStateError("that model is already in another pipeline: give it "
                                         "back with detach() there first")  # fmt: skip
            _SHARED.pop(id(self.model), None)
        self.model = model
        if shared:
            _SHARED[id(model)] = self

    def in_flight(self) -> int:
        """Batches in flight in every pipeline on this model."""
        return sum(engine.statistics().in_flight for engine in self.engines.values())

    def rewrite(
        self, peek: Any, context: TrainPipelineContext, *,
        forward_type: type[Any] = PipelinedForward, warm_up: TrainPipelineContext | None = None,
    ) -> Any:  # fmt: skip
        """Copy ``peek`` to the device, let torchrec rewrite the model on it and start
        its input distribution in ``context`` (torchrec's ``fill_pipeline``); return
        the copy.  With ``warm_up`` (a batch to be transformed, e.g. shuffled, before
        its own input distribution) one complete distribution runs in that throwaway
        context instead: it creates torchrec's input dists and leaves no collective
        pending.  Refused while another rewrite is installed on the model."""
        self._refuse_a_second_rewrite()
        pool = self.pool
        with pool.use("memcpy"):
            batch = peek.to(self.device, non_blocking=True)
        pool.wait_stream("data_dist", "memcpy")
        modules: list[Any] = []
        self._original_kjt_dist_forwards = []
        if any(isinstance(m, ShardedModule) for m in self.model.modules()):
            modules, _, self._original_forwards, _, _ = _rewrite_model(
                model=self.model,
                context=context,
                dist_stream=self.streams["data_dist"],
                default_stream=self.streams["default"],
                batch=batch,
                pipelined_forward=forward_type,
            )
        # else an unsharded model: nothing to distribute, the input-dist tasks idle
        self.modules[:] = modules
        self.rewritten = True
        _INSTALLED[id(self.model)] = self
        with pool.use("data_dist"):  # creates torchrec's input dists, then fuses their splits
            _start_data_dist(modules, batch, context if warm_up is None else warm_up)
            if warm_up is not None:
                for _, awaitable in warm_up.fused_splits_awaitables:
                    for request in awaitable.wait():
                        request.wait()
        self._original_kjt_dist_forwards = _override_input_dist_forwards(modules)
        return batch

    def restore(self) -> None:
        """Give the model its own forwards back; the next batch traces it again."""
        if self.modules:
            _pipeline_detach_model(
                model=self.model,
                pipelined_modules=self.modules,
                original_forwards=self._original_forwards,
                original_kjt_dist_forwards=self._original_kjt_dist_forwards,
                pipelined_postprocs=[],
            )
        self.modules.clear()
        self.rewritten = False
        if _INSTALLED.get(id(self.model)) is self:
            del _INSTALLED[id(self.model)]

    def _refuse_a_second_rewrite(self) -> None:
        installed = _INSTALLED.get(id(self.model))
        if installed is None or installed is self or installed.model is not self.model:
            return
        raise PipelineStateError(
            f"{installed.owner} already runs on this model, on torchrec's rewrite of its "
            f"forwards, and {self.owner} would rewrite them again on top of it; give the "
            f"model back first (drain() and detach(), or shutdown(), that pipeline), then "
            f"pass this source again: the batch taken from it is kept"
        )
