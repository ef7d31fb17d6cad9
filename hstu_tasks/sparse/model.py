"""One model's torchrec rewrite, shared by every sparse-dist pipeline on that model.

torchrec's ``rewrite_model`` (``_torchrec.py``) replaces the forwards of a model's
sharded modules with pipelined ones that read the input distribution from a per-batch
context.  A model can be rewritten once: a training and an evaluation pipeline on the
same model must share the rewrite (and the streams it was bound to), or the second
would wrap the first one's pipelined forwards.  ``PipelinedModel.of(model, device)``
returns the one shared object per model; ``PipelinedModel(model, device, owner=...)``
is one a pipeline keeps to itself (the HSTU pipeline: its prefetch variant installs
other forwards).  Either way a model runs under one of them at a time: another is
refused until the pipelines on the first give the model back.

On a CPU with one rank there is nothing to distribute, and torchrec's pipelined form
only adds work (a splits all-to-all per batch, which its unpipelined path skips on
one rank, and per-batch contexts): there the model keeps its own forwards unless
``pipelined_input_dist=True`` asks for the rewrite (:func:`input_dist_pipelined`).
"""

from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.runtime_forwards import PrefetchPipelinedForward
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardedModule

from aiopipe import ConfigurationError, PipelineStateError, SchedulablePipeline, StreamPool

from ._torchrec import override_input_dist_forwards, pipeline_detach_model, place_forwards
from ._torchrec import rewrite_model, start_data_dist

__all__ = (
    "STREAMS",
    "InputDistNotPipelinedError",
    "InputDistNotPipelinedWarning",
    "PipelinedModel",
    "carries_torchrec_rewrite",
    "input_dist_pipelined",
    "stream_pool",
)

#: torchrec's streams (the prefetch one for the HSTU pipeline's prefetch variant, the
#: embedding-lookup one for the fused schedule's ``emb_lookup_stream="new"``).
STREAMS = ("default", "memcpy", "data_dist", "prefetch", "embedding_lookup")


class InputDistNotPipelinedWarning(UserWarning):
    """torchrec's rewrite left a sharded module's input distribution inside forward:
    the step runs, but that module's input distribution is not overlapped.  Also
    warned: a model with no sharded module at all (nothing to distribute)."""


class InputDistNotPipelinedError(ConfigurationError):
    """``strict=True``: what :class:`InputDistNotPipelinedWarning` warns of, refused."""


#: Why torchrec's rewrite did not pipeline a sharded module.
_INPUT_COMPUTED = ("its input is computed inside forward, not read from the batch as it is "
                   "(torchrec can only start the distribution of a batch's own fields early)")
_NOT_REACHED = ("the torch.fx trace of forward does not call it with the batch's fields (it "
                "is called with no input, from a module traced as a leaf, or not at all)")


def _called_often(calls: int) -> str:
    return (f"forward calls it {calls} times, and torchrec can take the input distribution "
            f"of a module out of forward only when forward calls it once")


def not_pipelined(model: torch.nn.Module, pipelined: list[Any], input_computed: list[str],
                  called_often: dict[str, int] | None = None) -> dict[str, str]:  # fmt: skip
    """The sharded modules of ``model`` the rewrite did not pipeline, and why
    (``input_computed``: the names torchrec reports as having their input modified;
    ``called_often``: the calls of each module forward makes more than once)."""
    inner = model.module if isinstance(model, DistributedModelParallel) else model
    done = {id(module) for module in pipelined}
    often = called_often or {}
    return {name: _called_often(often[name]) if name in often
            else _INPUT_COMPUTED if name in input_computed else _NOT_REACHED
            for name, module in inner.named_modules()
            if isinstance(module, ShardedModule) and id(module) not in done}  # fmt: skip


def keep_modules_called_once(modules: list[Any], originals: list[Any]
                             ) -> tuple[list[Any], list[Any], dict[str, int]]:  # fmt: skip
    """torchrec's rewrite replaces a sharded module's forward once per place forward
    calls it, so a module called twice is listed twice, its second "original" forward
    the first pipelined one -- and fails at the second call of every step, its input
    distribution consumed by the first.  Give such a module its own forward back (it
    distributes its input inside forward, at every call): the modules called once and
    their original forwards, and the calls of each module given back, by name."""
    calls = collections.Counter(id(module) for module in modules)
    kept: list[Any] = []
    kept_originals: list[Any] = []
    given_back: dict[str, int] = {}
    restored: set[int] = set()
    for module, original in zip(modules, originals, strict=True):
        if calls[id(module)] == 1:
            kept.append(module)
            kept_originals.append(original)
        elif id(module) not in restored:  # the first listing: its own forward
            restored.add(id(module))
            given_back[module.forward.name] = calls[id(module)]
            module.forward = original
            module.is_pipelined = False
    return kept, kept_originals, given_back


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
        "embedding_lookup": torch.cuda.Stream(device=device),  # type: ignore[no-untyped-call]
    })  # fmt: skip


def input_dist_pipelined(requested: bool | None, device: torch.device) -> bool:
    """Whether a pipeline runs torchrec's input distribution as tasks of its own, a
    batch ahead (``requested``, when given).  By default yes, except on a CPU with one
    rank: there it moves no data, and its pipelined form cost about 0.6 ms of CPU a
    step on the HSTU demo (docs/performance.md)."""
    if requested is not None:
        return requested
    if device.type == "cuda":
        return True
    return dist.is_initialized() and dist.get_world_size() > 1


def carries_torchrec_rewrite(model: torch.nn.Module) -> bool:
    """Whether a sharded module of ``model`` has torchrec's pipelined forward: torchrec's
    own pipelines leave their rewrite installed, and a model that still carries it can
    only run rewritten (its own forwards are gone), one CPU rank or not."""
    return any(isinstance(m, ShardedModule) and isinstance(m.forward, BaseForward)
               for m in model.modules())  # fmt: skip


_SHARED: weakref.WeakValueDictionary[int, PipelinedModel] = weakref.WeakValueDictionary()
#: How to end a refusal because another kind of pipeline has the model.
_GIVE_BACK = ("; give the model back first (drain() and detach(), or shutdown(), the "
              "pipelines on it)")
#: The PipelinedModel each model runs under: its forwards (torchrec's rewrite, or the
#: model's own on one CPU rank) are that one's, and a second would wrap or miss them.
_INSTALLED: weakref.WeakValueDictionary[int, PipelinedModel] = weakref.WeakValueDictionary()


class PipelinedModel:
    """The model, its streams, and its rewrite once the first batch has traced it;
    ``owner`` names the pipelines on it, for the message that refuses another rewrite."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *,
                 owner: str = "a sparse-dist pipeline",
                 pipelined_input_dist: bool | None = None,
                 forward_type: type[BaseForward[Any]] = PipelinedForward) -> None:  # fmt: skip
        self.model = model
        self.owner = owner
        self.device = device
        #: The pipelined forward torchrec's rewrite installs (the fused schedule's reads
        #: an embedding lookup started by a task of its own, the HSTU prefetch
        #: variant's the prefetched input).
        self.forward_type = forward_type
        #: Whether the first batch rewrites the model (:func:`input_dist_pipelined`).
        self.pipelines_input_dist = input_dist_pipelined(pipelined_input_dist, device)
        #: Whether the rewrite was left out for this host only (one CPU rank), not by
        #: the schedule or the caller: ``strict`` then still checks what it would miss.
        self.rewrite_left_out_here = pipelined_input_dist is None and not self.pipelines_input_dist
        self.pool: StreamPool = stream_pool(device)
        self.streams: dict[str, Any] = {name: self.pool.get(name) for name in STREAMS}
        #: The sharded modules with pipelined forwards (a list the tasks share).
        self.modules: list[Any] = []
        #: The first batch has installed this object's forwards on the model.
        self.installed = False
        self.attached = True
        #: The pipeline whose progress() is running (they take turns).
        self.busy: Any = None
        #: Made by :meth:`of`, for every pipeline on the model to share (else one
        #: pipeline's own, as the HSTU pipeline's).
        self.shareable = False
        #: The pipelines on this model not shut down (``SparseDistBase`` adds itself).
        self.pipelines: weakref.WeakSet[Any] = weakref.WeakSet()
        #: The engine of each pipeline on this model (once built).
        self.engines: weakref.WeakKeyDictionary[Any, SchedulablePipeline] = (
            weakref.WeakKeyDictionary()
        )
        self._original_forwards: list[Any] = []
        self._original_kjt_dist_forwards: list[Any] = []

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device,
           pipelined_input_dist: bool | None = None,
           forward_type: type[BaseForward[Any]] | None = None, *,
           owner: str = "a sparse-dist pipeline") -> PipelinedModel:  # fmt: skip
        """The object every pipeline on ``model`` shares while any of them has it
        (:attr:`in_use`; ``pipelined_input_dist`` and ``forward_type`` given to a later
        pipeline must agree with the first one's); a new one once they have all given
        it back (shut down, or the model detached), for a pipeline of any kind.
        ``owner`` names the pipeline that makes a new one, in refusals."""
        shared = _SHARED.get(id(model))
        if shared is None or shared.model is not model or not shared.in_use:
            return cls._registered(cls(
                model, device, owner=owner, pipelined_input_dist=pipelined_input_dist,
                forward_type=forward_type or PipelinedForward,
            ))  # fmt: skip
        if shared.device != device:
            raise ValueError(f"the model already runs in {shared.owner} on {shared.device}; "
                             f"every pipeline on one model must use that device, got "
                             f"{device}{_GIVE_BACK}")  # fmt: skip
        if pipelined_input_dist not in (None, shared.pipelines_input_dist):
            raise ValueError(
                f"the model already runs in {shared.owner}, with pipelined_input_dist="
                f"{shared.pipelines_input_dist}; the pipelines on one model share it (this "
                f"schedule runs with {pipelined_input_dist}){_GIVE_BACK}"
            )
        if forward_type not in (None, shared.forward_type):
            raise ValueError(
                f"the model already runs in {shared.owner}, whose schedule installs "
                f"{shared.forward_type.__name__}; the pipelines on one model share its "
                f"rewrite, and this schedule needs {forward_type.__name__}{_GIVE_BACK}"
            )
        return shared

    @staticmethod
    def _registered(shared: PipelinedModel) -> PipelinedModel:
        """``shared`` as the object new pipelines on its model share (:meth:`of`)."""
        shared.shareable = True
        _SHARED[id(shared.model)] = shared
        return shared

    def claim(self) -> None:
        """Make this the object new pipelines on the model share (again): a pipeline
        detached while pipelines of another kind had the model, attached again, or
        making its evaluation pipeline.  Refused while another one has the model.  An
        object of a pipeline's own (not from :meth:`of`) stays its own."""
        if not self.shareable:
            return
        other = self._in_use_elsewhere(self.model)
        if other is not None:
            raise PipelineStateError(f"{other.owner} has this model now{_GIVE_BACK}")
        self._registered(self)

    def _in_use_elsewhere(self, model: torch.nn.Module) -> PipelinedModel | None:
        """The shared object of ``model``, if it is another one and still in use."""
        other = _SHARED.get(id(model))
        if other is None or other is self or other.model is not model or not other.in_use:
            return None
        return other

    def taken_by(self) -> PipelinedModel | None:
        """Another object whose forwards are installed on the model, if any."""
        installed = _INSTALLED.get(id(self.model))
        if installed is None or installed is self or installed.model is not self.model:
            return None
        return installed

    @property
    def in_use(self) -> bool:
        """Whether a pipeline still has the model: one not shut down, the model not
        detached (or its forwards still installed)."""
        return self.installed or (self.attached and bool(self.pipelines))

    @property
    def looks_up_embeddings(self) -> bool:
        """Whether the installed forwards read an embedding lookup a task started
        (torchrec's fused schedule) rather than the input distribution."""
        return issubclass(self.forward_type, EmbeddingPipelinedForward)

    @property
    def prefetches(self) -> bool:
        """Whether the installed forwards read inputs a prefetch task kept (torchrec's
        prefetch schedule) rather than the input distribution."""
        return issubclass(self.forward_type, PrefetchPipelinedForward)

    def replace_model(self, model: torch.nn.Module) -> None:
        """``attach(model)``: the pipelines go on with another model."""
        if self._in_use_elsewhere(model) is not None:
            raise PipelineStateError("that model is already in another pipeline: give it "
                                     "back with detach() there first")  # fmt: skip
        if _SHARED.get(id(self.model)) is self:
            del _SHARED[id(self.model)]
        self.model = model
        if self.shareable:
            self._registered(self)

    def in_flight(self) -> int:
        """Batches in flight in every pipeline on this model."""
        return sum(engine.statistics().in_flight for engine in self.engines.values())

    def rewrite(
        self, peek: Any, context: TrainPipelineContext, *,
        warm_up: TrainPipelineContext | None = None, strict: bool = False,
    ) -> Any:  # fmt: skip
        """Copy ``peek`` to the device, let torchrec rewrite the model on it (unless it
        keeps its own forwards: :func:`input_dist_pipelined`) and start its input
        distribution in ``context`` (torchrec's ``fill_pipeline``); return the copy.
        With ``warm_up`` (a batch to be transformed, e.g. shuffled, before its own
        input distribution) one complete distribution runs in that throwaway context
        instead: it creates torchrec's input dists and leaves no collective pending.
        Refused while another pipeline kind is installed on the model.  A sharded module
        the rewrite cannot pipeline is warned of (:class:`InputDistNotPipelinedWarning`),
        or with ``strict`` refused, the model left as it was; ``strict`` checks where
        only this host leaves the rewrite out (:attr:`rewrite_left_out_here`) too, by
        rewriting and restoring the model at once."""
        self._refuse_a_second_rewrite()
        pool = self.pool
        with pool.use("memcpy"):
            batch = peek.to(self.device, non_blocking=True)
        pool.wait_stream("data_dist", "memcpy")
        modules: list[Any] = []
        missed: dict[str, str] = {}
        self._original_kjt_dist_forwards = []
        sharded = [m for m in self.model.modules() if isinstance(m, ShardedModule)]
        rewrites = self.pipelines_input_dist or carries_torchrec_rewrite(self.model)
        if sharded and (rewrites or (strict and self.rewrite_left_out_here)):
            modules, _, originals, _, input_computed = rewrite_model(
                model=self.model,
                context=context,
                dist_stream=self.streams["data_dist"],
                default_stream=self.streams["default"],
                batch=batch,
                pipelined_forward=self.forward_type,
            )
            modules, self._original_forwards, called_often = keep_modules_called_once(
                modules, originals)  # fmt: skip
            place_forwards(modules, self.device)
            missed = not_pipelined(self.model, modules, input_computed, called_often)
            if not rewrites:
                # strict's check only (one CPU rank by default): what a rewrite would
                # miss is known; the model keeps its own forwards.
                self.modules[:] = modules
                self.restore()
                modules = []
        # else nothing to distribute, or left to the model's own forward: the
        # input-dist tasks idle
        self.modules[:] = modules
        self._report_not_pipelined(missed, len(sharded), strict)
        self.installed = True
        _INSTALLED[id(self.model)] = self
        with pool.use("data_dist"):  # creates torchrec's input dists, then fuses their splits
            start_data_dist(modules, batch, context if warm_up is None else warm_up)
            if warm_up is not None:
                for _, awaitable in warm_up.fused_splits_awaitables:
                    for request in awaitable.wait():
                        request.wait()
        self._original_kjt_dist_forwards = override_input_dist_forwards(modules)
        return batch

    def _report_not_pipelined(self, missed: dict[str, str], sharded: int, strict: bool) -> None:
        if sharded == 0:
            message = (
                f"{self.owner}: the model has no module sharded by torchrec (its "
                f"DistributedModelParallel shards the embedding tables), so there is no "
                f"input distribution to pipeline, and each rank trains tables of its own: "
                f"shard the model first"
            )
        elif missed:
            listed = "; ".join(f"{name!r}: {why}" for name, why in missed.items())
            message = (
                f"{self.owner}: torchrec's rewrite pipelines the input distribution of "
                f"{sharded - len(missed)} of the model's {sharded} sharded module(s); not "
                f"of {listed}. Their input distribution runs inside forward, not "
                f"overlapped with the step before: pass each sharded module a field of "
                f"the batch as it is to pipeline it"
            )
        else:
            return
        if strict:
            self.restore()
            raise InputDistNotPipelinedError(message + " (strict=True refuses this)")
        warnings.warn(message + " (strict=True makes this an error)",
                      InputDistNotPipelinedWarning, stacklevel=2)  # fmt: skip

    def restore(self) -> None:
        """Give the model its own forwards back; the next batch traces it again."""
        if self.modules:
            pipeline_detach_model(
                model=self.model,
                pipelined_modules=self.modules,
                original_forwards=self._original_forwards,
                original_kjt_dist_forwards=self._original_kjt_dist_forwards,
                pipelined_postprocs=[],
            )
        self.modules.clear()
        self.installed = False
        if _INSTALLED.get(id(self.model)) is self:
            del _INSTALLED[id(self.model)]

    def _refuse_a_second_rewrite(self) -> None:
        installed = self.taken_by()
        if installed is None:
            return
        raise PipelineStateError(
            f"{installed.owner} already runs on this model, and {self.owner} cannot run "
            f"beside it: each kind installs the forwards it runs (torchrec's rewrite, or "
            f"the model's own){_GIVE_BACK}, then pass this source again: the batch taken "
            f"from it is kept"
        )
