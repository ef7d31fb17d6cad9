"""The private torchrec functions the adapter depends on, in one place.

torchrec's pipelines (``TrainPipelineSparseDist`` and its family) run their per-batch
steps through helpers that torchrec keeps private: it exports no public way to
rewrite a model for pipelined input distribution, or to undo that.  Running those
steps as separate tasks needs the same helpers, so they are imported here, under
public names, and nowhere else (``tests/test_import_hygiene.py`` holds every other
module to that): when torchrec renames or changes one, this is the file to adapt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward

# ``fill_pipeline``'s first step: replace the forwards of the model's sharded modules
# with pipelined ones that read their input distribution from a per-batch context.
from torchrec.distributed.train_pipeline.utils import _rewrite_model as rewrite_model

# ``start_sparse_data_dist``: issue a batch's input distribution (the splits
# all-to-all) into its context, on the pipelined modules.
from torchrec.distributed.train_pipeline.utils import _start_data_dist as start_data_dist

# After the first input distribution has created the modules' input dists: make them
# fuse their splits all-to-alls into one collective (torchrec's own pipelines do);
# returns the forwards it replaced.
from torchrec.distributed.train_pipeline.utils import (
    _override_input_dist_forwards as override_input_dist_forwards,
)

# ``detach()``: give the model its original forwards (modules and input dists) back.
from torchrec.distributed.train_pipeline.utils import (
    _pipeline_detach_model as pipeline_detach_model,
)

# TrainPipelineFusedSparseDist's ``start_embedding_lookup``, for one module: wait for
# its input distribution, start its lookup and output distribution into the context.
from torchrec.distributed.train_pipeline.utils import (
    _start_embedding_lookup as start_embedding_lookup,
)


def place_forwards(modules: list[Any], device: torch.device) -> None:
    """Give the pipelined forwards of ``modules`` the pipeline's device: torchrec's take
    theirs from their stream, and assume CUDA without one (a CPU run), which its
    embedding-lookup forwards then ask for their current stream."""
    for module in modules:
        module.forward._device = device


@contextlib.contextmanager
def torchrec_classes_on_cpu() -> Iterator[None]:
    """For the duration, torchrec's fused and semi-sync train pipelines run on a CPU (as
    shipped they need CUDA): ``Tensor.record_stream`` skips CPU tensors (they have no
    stream to record, and torchrec calls it with the CPU's), and a pipelined forward
    made without a stream takes the CPU as its device (torchrec assumes CUDA).  For
    reference runs of torchrec's own classes only: aiopipe's schedules need neither."""
    record_stream = torch.Tensor.record_stream
    forward_init = BaseForward.__init__

    def record_stream_off_cpu(tensor: torch.Tensor, stream: Any) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)

    def init_on_cpu(forward: Any, *args: Any, **kwargs: Any) -> None:
        forward_init(forward, *args, **kwargs)
        if forward._stream is None:
            forward._device = torch.device("cpu")

    torch.Tensor.record_stream = record_stream_off_cpu  # type: ignore[method-assign,assignment]
    BaseForward.__init__ = init_on_cpu
    try:
        yield
    finally:
        torch.Tensor.record_stream = record_stream  # type: ignore[method-assign]
        BaseForward.__init__ = forward_init


__all__ = (
    "override_input_dist_forwards",
    "pipeline_detach_model",
    "place_forwards",
    "rewrite_model",
    "start_data_dist",
    "start_embedding_lookup",
    "torchrec_classes_on_cpu",
)
