"""hstu_tasks: the HSTU generative-recommender ranking step as aiopipe tasks.

The adapter layer on top of aiopipe (torchrec, fbgemm and megatron-core may be
imported here, never in ``aiopipe``):

* ``data`` -- synthetic jagged HSTU batches (``HSTUBatch``, ``SyntheticHSTUData``);
* ``model`` -- a small HSTU ranking model on a torchrec ``EmbeddingCollection``;
* ``parallel`` -- sharding, optimizers and the plain reference step;
* ``megatron`` -- Megatron DDP and Megatron's optimizer for the dense part (GPU);
* ``shuffler`` -- workload-balancing batch shuffling across ranks;
* ``tasks`` / ``pipeline`` / ``factory`` -- the fourteen tasks, ``HSTUPipeline`` and
  its named variants;
* ``checkpoint`` -- saving and restoring the training state at a progress boundary;
* ``elastic`` -- jobs that resume on any number of ranks (``ResumableJob``), with
  ``global_order`` -- the one sample order their data is cut from;
* ``sparse`` -- the generic part, of which the HSTU pipeline is composed: torchrec's
  sparse-dist train and eval pipelines for any sharded model (``SparseDistPipeline``,
  ``SparseDistEvalPipeline``), and torchrec's DLRM, sharded, with synthetic data and
  its runners (``sparse.dlrm``, ``sparse.dlrm_runs``).
"""

from __future__ import annotations

from .checkpoint import restore_training as restore_training
from .checkpoint import training_state as training_state
from .data import DataConfig as DataConfig
from .data import HSTUBatch as HSTUBatch
from .data import SyntheticHSTUData as SyntheticHSTUData
from .factory import HSTUPipelineFactory as HSTUPipelineFactory
from .factory import UnknownPipelineError as UnknownPipelineError
from .megatron import MegatronDataParallelWrapper as MegatronDataParallelWrapper
from .model import HSTURankingModel as HSTURankingModel
from .model import ModelConfig as ModelConfig
from .parallel import DataParallel as DataParallel
from .parallel import OptimizerConfig as OptimizerConfig
from .parallel import TrainingSetup as TrainingSetup
from .parallel import build_training as build_training
from .parallel import init_distributed as init_distributed
from .parallel import join_local_group as join_local_group
from .parallel import leave_and_exit as leave_and_exit
from .parallel import plain_train_step as plain_train_step
from .parallel import quiet_torchrec as quiet_torchrec
from .parallel import shard_model as shard_model
from .parallel import stop_on_ctrl_c as stop_on_ctrl_c
from .pipeline import HSTU_DEFAULT_THREAD_MAP as HSTU_DEFAULT_THREAD_MAP
from .pipeline import HSTU_DIST_LANE_THREAD_MAP as HSTU_DIST_LANE_THREAD_MAP
from .pipeline import HSTU_IO_LANE_THREAD_MAP as HSTU_IO_LANE_THREAD_MAP
from .pipeline import HSTUPipeline as HSTUPipeline
from .shuffler import IdentityShuffler as IdentityShuffler
from .shuffler import KarmarkarKarpShuffler as KarmarkarKarpShuffler
from .shuffler import balanced_partition as balanced_partition
from .sparse import SPARSE_DIST_THREAD_MAP as SPARSE_DIST_THREAD_MAP
from .sparse import DLRMConfig as DLRMConfig
from .sparse import InputDistNotPipelinedError as InputDistNotPipelinedError
from .sparse import InputDistNotPipelinedWarning as InputDistNotPipelinedWarning
from .sparse import SparseDistEvalPipeline as SparseDistEvalPipeline
from .sparse import SparseDistPipeline as SparseDistPipeline
from .sparse import SyntheticDLRMData as SyntheticDLRMData
from .sparse import build_dlrm_training as build_dlrm_training

__all__ = (
    "HSTU_DEFAULT_THREAD_MAP",
    "HSTU_DIST_LANE_THREAD_MAP",
    "HSTU_IO_LANE_THREAD_MAP",
    "SPARSE_DIST_THREAD_MAP",
    "DLRMConfig",
    "DataConfig",
    "DataParallel",
    "HSTUBatch",
    "HSTUPipeline",
    "HSTUPipelineFactory",
    "UnknownPipelineError",
    "InputDistNotPipelinedError",
    "InputDistNotPipelinedWarning",
    "HSTURankingModel",
    "IdentityShuffler",
    "KarmarkarKarpShuffler",
    "MegatronDataParallelWrapper",
    "ModelConfig",
    "OptimizerConfig",
    "SparseDistEvalPipeline",
    "SparseDistPipeline",
    "SyntheticDLRMData",
    "SyntheticHSTUData",
    "TrainingSetup",
    "balanced_partition",
    "build_dlrm_training",
    "build_training",
    "init_distributed",
    "join_local_group",
    "leave_and_exit",
    "plain_train_step",
    "quiet_torchrec",
    "restore_training",
    "shard_model",
    "stop_on_ctrl_c",
    "training_state",
)
