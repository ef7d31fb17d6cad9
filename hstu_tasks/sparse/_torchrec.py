"""The private torchrec functions the adapter depends on, in one place.

torchrec's pipelines (``TrainPipelineSparseDist`` and its family) run their per-batch
steps through helpers that torchrec keeps private: it exports no public way to
rewrite a model for pipelined input distribution, or to undo that.  Running those
steps as separate tasks needs the same helpers, so they are imported here, under
public names, and nowhere else (``tests/test_import_hygiene.py`` holds every other
module to that): when torchrec renames or changes one, this is the file to adapt.
"""

from __future__ import annotations

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

__all__ = (
    "override_input_dist_forwards",
    "pipeline_detach_model",
    "rewrite_model",
    "start_data_dist",
)
