"""torchrec's train pipelines as aiopipe schedules: one task-list builder per torchrec
class, looked up by name (``SparseDistPipeline(..., schedule=NAME)``).

===========  ===============================  =============================================
name         torchrec class                   one progress
===========  ===============================  =============================================
sparse-dist  ``TrainPipelineSparseDist``      copy i+2, input dist i+1, step i
lite         ``TrainPipelineSparseDistLite``  copy i+1; input dist i and step i
base         ``TrainPipelineBase``            copy i+1; step i on the model's own forward
fused        ``TrainPipelineFusedSparseDist``  sparse-dist, the embedding lookup of i first,
                                              on its own stream (:func:`fused`)
semi-sync    ``TrainPipelineSemiSync``        copy i+3, input dist i+2, lookup i+1 before
                                              step i's update (:func:`semi_sync`)
pt2          ``TrainPipelinePT2``             Base, the model compiled at step N (:func:`pt2`)
prefetch     ``PrefetchTrainPipelineSparse    copy and input dist i+2, embedding-cache
             Dist``                           prefetch i+1, step i
===========  ===============================  =============================================

The members share their tasks (``tasks.py``) and differ in where they place them:
how far ahead the copy and the input distribution run, on which stream, and whether
torchrec's rewrite distributes the input at all.  Each list is declared in its torchrec
class's host order, so the ranks issue their collectives in torchrec's order and the
step computes what torchrec's does, bit for bit.  torchrec writes one class with its
own ``progress`` per member; here a member is a builder and a row of
:data:`TRAIN_SCHEDULES`, and a member with options of its own (torchrec's
constructor knobs) is made by a function that takes them (:func:`fused`,
:func:`semi_sync`, :func:`pt2`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward
from torchrec.distributed.train_pipeline.runtime_forwards import InSyncEmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.runtime_forwards import PrefetchPipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig
from torchrec.pt2.utils import default_pipeline_input_transformer

from aiopipe import ConfigurationError, ConfigurationTypeError, Task, TaskContext

from .checks import check_flags
from .model import carries_torchrec_rewrite
from .semi_sync import DetachedEmbeddingForward, build_semi_sync_tasks
from .tasks import SparseDistState, StepLayout, build_sparse_dist_tasks, embedding_lookup_task
from .tasks import pipelined_step_tasks, prefetch_embeddings_task, training_tasks

__all__ = ("SCHEDULE_KNOBS", "TRAIN_SCHEDULES", "TrainSchedule", "build_base_tasks",
           "build_lite_tasks", "build_prefetch_tasks", "check_compile_backend", "fused", "pt2",
           "semi_sync", "train_schedule")  # fmt: skip


def build_lite_tasks(state: SparseDistState) -> list[Task]:
    """torchrec's ``TrainPipelineSparseDistLite``: one batch in flight, its copy made a
    progress ahead (after backward, before the optimizer step, as torchrec enqueues
    it); the input distribution of the batch being trained starts and finishes on the
    critical path, on the default stream (Lite has no ``data_dist`` stream)."""
    step = pipelined_step_tasks(state, StepLayout(depth=0, dist_stream="default"))
    train = training_tasks(state)
    return [train["zero_grad"], step["start_input_dist"], step["wait_input_dist"],
            step["forward"], train["backward"], step["h2d"], train["optimizer_step"]]  # fmt: skip


def build_prefetch_tasks(state: SparseDistState) -> list[Task]:
    """torchrec's ``PrefetchTrainPipelineSparseDist``: three batches in flight -- the
    copy of batch i+2 early in step i and its input distribution started at the end,
    the input distribution of i+1 finished before the forward of i and its
    embedding-cache prefetch (UVM-cached tables on a GPU) after it, on a stream of
    its own -- so the lookup of i+1 finds its rows already in the cache."""
    step = pipelined_step_tasks(state, StepLayout(forward_input="prefetched",
                                                  start_with_copy=True))  # fmt: skip
    train = training_tasks(state)
    prefetch = prefetch_embeddings_task(state, lambda: state.default_stream)
    return [train["zero_grad"], step["h2d"], step["wait_input_dist"], step["forward"], prefetch,
            train["backward"], train["optimizer_step"], step["start_input_dist"]]  # fmt: skip


def build_base_tasks(state: SparseDistState) -> list[Task]:
    """torchrec's ``TrainPipelineBase``: Lite's order without the input-dist tasks --
    the model's own forward distributes its input.  A model that still carries
    torchrec's rewrite (torchrec's pipelines leave it installed) has no forward of its
    own left to run, so it gets Lite's tasks, which compute the same step (torchrec's
    ``TrainPipelineBase`` fails on such a model: its forwards want a context)."""
    if carries_torchrec_rewrite(state.model):
        return build_lite_tasks(state)
    step = pipelined_step_tasks(state, StepLayout(depth=0, forward_input=None))
    train = training_tasks(state)
    return [train["zero_grad"], step["forward"], train["backward"], step["h2d"],
            train["optimizer_step"]]  # fmt: skip


@dataclass(frozen=True)
class TrainSchedule:
    """One member of the family: its name, the torchrec class it equals, its builder."""

    name: str
    torchrec_class: str
    build_tasks: Callable[[SparseDistState], list[Task]]
    #: Whether the input distribution may run as tasks on torchrec's rewrite of the
    #: model (``pipelined_input_dist``); ``False``: never, the model's forward does it;
    #: ``"always"``: the schedule's step is computed on the rewrite only (semi-sync's
    #: stale embeddings), one CPU rank too.
    rewrites: bool | Literal["always"] = True
    #: Whether the torchrec class offers ``execute_all_batches=False`` (here: the last
    #: two batches read and dropped, as ``TrainPipelineSparseDist`` does).
    drops_last_two: bool = False
    #: The pipelined forward torchrec's rewrite installs for it.
    forward_type: type[BaseForward[Any]] = PipelinedForward
    #: The knobs it was made with (``semi_sync(start_batch=2)``'s), for
    #: :func:`train_schedule` to add to.
    knobs: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


#: ``emb_lookup_stream`` of torchrec's fused class, and aiopipe's stream for each.
EmbeddingLookupStream = Literal["data_dist", "current", "new"]
_LOOKUP_STREAMS: dict[str, str] = {"data_dist": "data_dist", "current": "default",
                                   "new": "embedding_lookup"}  # fmt: skip


def fused(*, embedding_lookup_after_data_dist: bool = False,
          emb_lookup_stream: EmbeddingLookupStream = "data_dist") -> TrainSchedule:  # fmt: skip
    """torchrec's ``TrainPipelineFusedSparseDist`` with its knobs: sparse-dist, with the
    embedding lookup (and output distribution) of the batch to train a task of its own
    on ``emb_lookup_stream`` (the input-dist stream by default, ``"current"``: the
    forward's, ``"new"``: a stream of its own).  torchrec starts it first in the step,
    before ``zero_grad``; here it is the last task of the step before, after the
    optimizer step -- the same host order -- so that on a GPU it waits for the
    previous ``backward`` (where a fused optimizer updates the tables) and overlaps
    the optimizer step.  ``embedding_lookup_after_data_dist``: the lookup starts after
    the next batches' input distribution and copy, in the step itself (on a GPU
    after its ``zero_grad``).  ``SparseDistPipeline(..., schedule=fused(...))``;
    ``schedule="fused"`` is the default knobs."""
    check_flags(embedding_lookup_after_data_dist=embedding_lookup_after_data_dist)
    if emb_lookup_stream not in _LOOKUP_STREAMS:
        raise ConfigurationError(f"emb_lookup_stream must be one of {', '.join(_LOOKUP_STREAMS)}, "
                         f"got {emb_lookup_stream!r}")  # fmt: skip
    stream = _LOOKUP_STREAMS[emb_lookup_stream]

    def build(state: SparseDistState) -> list[Task]:
        step = pipelined_step_tasks(state, StepLayout(forward_input="looked_up"))
        train = training_tasks(state)
        ahead = 0 if embedding_lookup_after_data_dist else 1
        lookup = embedding_lookup_task(state, stream=stream, lookahead=ahead)
        tasks = [train["zero_grad"], step["start_input_dist"], step["h2d"], step["forward"],
                 step["wait_input_dist"], train["backward"], train["optimizer_step"]]  # fmt: skip
        tasks.insert(3 if embedding_lookup_after_data_dist else len(tasks), lookup)
        return tasks

    knobs = {"embedding_lookup_after_data_dist": embedding_lookup_after_data_dist,
             "emb_lookup_stream": emb_lookup_stream}  # fmt: skip
    return TrainSchedule("fused", "TrainPipelineFusedSparseDist", build, drops_last_two=True,
                         forward_type=InSyncEmbeddingPipelinedForward, knobs=knobs)  # fmt: skip


def semi_sync(*, start_batch: int = 900, stash_gradients: bool = False) -> TrainSchedule:
    """torchrec's ``TrainPipelineSemiSync(start_batch=..., stash_gradients=...)``: from
    step ``start_batch`` on (counted from the pipeline's construction or ``reset()``)
    the lookup of batch i+1 is issued before batch i's backward, so its embeddings are
    one update stale; before it, after the optimizer step.  ``stash_gradients``: each
    step applies the previous batch's dense gradients.  Four batches in flight: copy
    i+3, input dist i+2, lookup i+1 (``semi_sync.py``).
    ``SparseDistPipeline(..., schedule=semi_sync(...))``; ``schedule="semi-sync"`` is
    the default knobs."""
    if isinstance(start_batch, bool) or not isinstance(start_batch, int) or start_batch < 0:
        raise ConfigurationError(f"start_batch must be an int >= 0, got {start_batch!r}")
    check_flags(stash_gradients=stash_gradients)

    def build(state: SparseDistState) -> list[Task]:
        return build_semi_sync_tasks(state, start_batch, stash_gradients)

    knobs = {"start_batch": start_batch, "stash_gradients": stash_gradients}
    return TrainSchedule("semi-sync", "TrainPipelineSemiSync", build, rewrites="always",
                         drops_last_two=True, forward_type=DetachedEmbeddingForward,
                         knobs=knobs)  # fmt: skip


ModelHook = Callable[[torch.nn.Module], None]


def pt2(*, compile_configs: TorchCompileConfig | None = None,
        pre_compile_fn: ModelHook | None = None, post_compile_fn: ModelHook | None = None,
        input_transformer: Callable[[Any], Any] | None = None) -> TrainSchedule:  # fmt: skip
    """torchrec's ``TrainPipelinePT2`` with its knobs: Base's step on the model's own
    forward, which ``torch.compile`` compiles at step ``compile_configs.compile_on_iter``
    (counted from the pipeline's construction; torchrec's ``TorchCompileConfig``:
    ``fullgraph``, ``dynamic``, ``backend``), between ``pre_compile_fn(model)`` and
    ``post_compile_fn(model)``, with the dynamo settings torchrec's class makes.  Each
    batch goes through ``input_transformer`` (torchrec's default: KJT hints for the
    compiler) right before the forward.  Unlike torchrec's class, which copies each
    batch in the step, blocking, the copy runs a batch ahead, as in Base.
    ``SparseDistPipeline(..., schedule=pt2(...))``; ``schedule="pt2"`` is the defaults."""
    if compile_configs is not None and not isinstance(compile_configs, TorchCompileConfig):
        raise ConfigurationTypeError(
            f"compile_configs must be torchrec's TorchCompileConfig (torchrec.distributed."
            f"train_pipeline.train_pipelines), got {type(compile_configs).__name__}"
        )
    for name, hook in (("pre_compile_fn", pre_compile_fn), ("post_compile_fn", post_compile_fn),
                       ("input_transformer", input_transformer)):  # fmt: skip
        if hook is not None and not callable(hook):
            raise ConfigurationTypeError(f"{name} must be callable, got {hook!r}")
    configs = compile_configs or TorchCompileConfig()
    transform = input_transformer or default_pipeline_input_transformer

    def build(state: SparseDistState) -> list[Task]:
        check_compile_backend(configs.backend)  # at the build, not at the compile
        step = pipelined_step_tasks(state, StepLayout(depth=0, forward_input=None))  # h2d
        train = training_tasks(state)

        def forward(ctx: TaskContext) -> None:
            if state.steps_trained == configs.compile_on_iter and not _compiled(state.model):
                _compile(state.model, configs, pre_compile_fn, post_compile_fn)
            batch = transform(ctx.slots["batch"])
            with torch.set_grad_enabled(state.training):
                losses, output = state.run_model(batch)
            ctx.slots.set("losses", losses)
            ctx.slots.set("output", output)

        def backward(ctx: TaskContext) -> None:
            if state.training:
                torch.sum(ctx.slots["losses"]).backward()  # torchrec's PT2: every element

        return [
            train["zero_grad"],
            Task.from_fn("forward", forward, nccl=True, reads=("batch",),
                         writes=("losses", "output"), depends_on=("zero_grad",)),
            Task.from_fn("backward", backward, nccl=True, reads=("losses",),
                         depends_on=("forward",)),
            step["h2d"], train["optimizer_step"],
        ]  # fmt: skip

    knobs = {"compile_configs": compile_configs, "pre_compile_fn": pre_compile_fn,
             "post_compile_fn": post_compile_fn, "input_transformer": input_transformer}
    return TrainSchedule("pt2", "TrainPipelinePT2", build, rewrites=False, knobs=knobs)


def check_compile_backend(backend: Any) -> None:
    """Refuse a backend named by a string that ``torch.compile`` does not know
    (``ValueError``): when the pipeline is built, not steps later when the model
    compiles."""
    if not isinstance(backend, str):
        return  # a callable backend: torch.compile takes it as it is
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigurationError(f"compile_configs.backend {backend!r} is not a torch.compile "
                         f"backend; known: {', '.join(torch._dynamo.list_backends())}")  # fmt: skip


def _compiled(model: torch.nn.Module) -> bool:
    """Whether ``model.compile()`` has run (once per model: a ``reset()`` counts the
    steps from 0 again, and must not compile it twice)."""
    return getattr(model, "_compiled_call_impl", None) is not None


def _compile(model: torch.nn.Module, configs: TorchCompileConfig, pre: ModelHook | None,
             post: ModelHook | None) -> None:  # fmt: skip
    """``model.compile`` as torchrec's ``TrainPipelinePT2`` does it, its dynamo settings
    for torchrec's jagged tensors included (they are global, as there)."""
    if pre is not None:
        pre(model)
    dynamo = torch._dynamo.config
    dynamo.capture_scalar_outputs = True
    dynamo.capture_dynamic_output_shape_ops = True
    dynamo.force_unspec_int_unbacked_size_like_on_torchrec_kjt = True
    dynamo.skip_torchrec = False
    torch.ops.import_module("fbgemm_gpu.sparse_ops")  # type: ignore[no-untyped-call]
    model.compile(fullgraph=configs.fullgraph, dynamic=configs.dynamic, backend=configs.backend)
    if post is not None:
        post(model)


#: The members by name, the default first.
TRAIN_SCHEDULES: dict[str, TrainSchedule] = {
    schedule.name: schedule
    for schedule in (
        TrainSchedule("sparse-dist", "TrainPipelineSparseDist", build_sparse_dist_tasks,
                      drops_last_two=True),
        TrainSchedule("lite", "TrainPipelineSparseDistLite", build_lite_tasks),
        TrainSchedule("base", "TrainPipelineBase", build_base_tasks, rewrites=False),
        fused(),
        semi_sync(),
        pt2(),
        TrainSchedule("prefetch", "PrefetchTrainPipelineSparseDist", build_prefetch_tasks,
                      drops_last_two=True, forward_type=PrefetchPipelinedForward),
    )
}  # fmt: skip

#: The members with knobs of their own, by name: the function that takes them.
SCHEDULE_KNOBS: dict[str, Callable[..., TrainSchedule]] = {
    "fused": fused, "semi-sync": semi_sync, "pt2": pt2,
}


def train_schedule(name: str | TrainSchedule, knobs: Mapping[str, Any] | None = None
                   ) -> TrainSchedule:  # fmt: skip
    """The member called ``name`` (a :class:`TrainSchedule` is its own), with ``knobs``
    (torchrec's constructor arguments of that member's class, ``{"start_batch": 2}``);
    :class:`~aiopipe.ConfigurationError` (a ``ValueError``) naming the members, or the
    member's knobs, otherwise."""
    if isinstance(name, TrainSchedule):
        if not knobs:
            return name
        knobs, name = {**name.knobs, **knobs}, name.name  # its own knobs, and these
    if name in SCHEDULE_KNOBS.values():
        called = getattr(name, "__name__", "")
        raise ConfigurationError(f"schedule={called}: call it, {called}(...), with its knobs")
    if knobs:
        factory = SCHEDULE_KNOBS.get(name)
        if factory is None:
            raise ConfigurationError(f"schedule {name!r} takes no knobs; those with knobs: "
                             f"{', '.join(map(repr, SCHEDULE_KNOBS))}")  # fmt: skip
        try:
            return factory(**knobs)
        except TypeError as error:
            raise ConfigurationError(f"schedule {name!r}: {error}") from None
    try:
        return TRAIN_SCHEDULES[name]
    except (KeyError, TypeError):
        close = (difflib.get_close_matches(name.replace("_", "-"), TRAIN_SCHEDULES, n=1)
                 if isinstance(name, str) else [])  # fmt: skip
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigurationError(f"unknown schedule {name!r}{hint}; choose one of "
                         f"{', '.join(map(repr, TRAIN_SCHEDULES))}") from None  # fmt: skip
