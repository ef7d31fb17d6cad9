"""hstu_tasks.sparse: torchrec's sparse-dist train and eval pipelines for any sharded
model, on aiopipe's engine.

* ``tasks`` -- the tasks of torchrec's ``TrainPipelineSparseDist`` step
  (``pipelined_step_tasks``, shared with the HSTU step; ``training_tasks``) and
  their default lanes;
* ``schedules`` -- torchrec's train pipelines (sparse-dist, Lite, Base, Fused,
  Semi-sync, PT2, Prefetch) as task lists, one builder each, looked up by
  ``SparseDistPipeline(..., schedule=NAME)`` (``schedule=fused(...)``,
  ``semi_sync(...)``, ``pt2(...)`` for their knobs; ``semi_sync.py`` holds its tasks);
* ``accumulation`` -- ``grad_accumulation=k`` for every schedule;
* ``staged`` -- torchrec's ``StagedTrainPipeline`` stages, and the step its loop
  runs, as tasks (``staged_pipeline``);
* ``model`` -- one model's torchrec rewrite, shared by the pipelines on it;
* ``checks`` -- the pipelines' arguments, checked when one is built;
* ``agreement`` -- ``end_together``: the ranks' agreement on the end of an epoch;
* ``spec`` -- ``PipelineSpec``: what one kind of pipeline gives the base (its tasks,
  its rewrite of the model on the first batch, its batch check, ...);
* ``base`` -- what every pipeline on a rewritten model shares: the progress contract,
  the bootstrap that traces the model on the first batch, the lifetime;
* ``blocking`` -- their blocking form, with ``detach``/``attach``/``eval_pipeline``;
* ``engine_executors`` -- the executor each engine of a pipeline gets;
* ``pipeline`` -- ``SparseDistPipeline`` and ``SparseDistEvalPipeline``;
* ``sources`` -- ``execute_all_batches=False`` as a source wrapper, and one pass of a
  torchrec pipeline;
* ``dlrm`` -- torchrec's DLRM, sharded, with synthetic data and its runners.

The HSTU pipeline (``hstu_tasks.pipeline``) is composed from the same parts: the base
with a spec of its own, and ``pipelined_step_tasks`` among its tasks.  The private
torchrec helpers the pipelines need are imported in ``_torchrec`` only.
"""

from __future__ import annotations

from .base import SparseDistBase as SparseDistBase
from .blocking import BlockingSparseDist as BlockingSparseDist
from .dlrm import DLRMConfig as DLRMConfig
from .dlrm import SyntheticDLRMData as SyntheticDLRMData
from .dlrm import build_dlrm_training as build_dlrm_training
from .dlrm_runs import DLRM_PIPELINES as DLRM_PIPELINES
from .dlrm_runs import DLRMRun as DLRMRun
from .dlrm_runs import evaluate_plainly as evaluate_plainly
from .dlrm_runs import run_dlrm as run_dlrm
from .model import STREAMS as STREAMS
from .model import InputDistNotPipelinedError as InputDistNotPipelinedError
from .model import InputDistNotPipelinedWarning as InputDistNotPipelinedWarning
from .model import PipelinedModel as PipelinedModel
from .model import carries_torchrec_rewrite as carries_torchrec_rewrite
from .model import input_dist_pipelined as input_dist_pipelined
from .model import stream_pool as stream_pool
from .pipeline import SparseDistEvalPipeline as SparseDistEvalPipeline
from .pipeline import SparseDistPipeline as SparseDistPipeline
from .schedules import TRAIN_SCHEDULES as TRAIN_SCHEDULES
from .schedules import TrainSchedule as TrainSchedule
from .schedules import fused as fused
from .schedules import pt2 as pt2
from .schedules import semi_sync as semi_sync
from .schedules import train_schedule as train_schedule
from .sources import AgreementGroups as AgreementGroups
from .sources import SourceWrappers as SourceWrappers
from .sources import agreement_groups as agreement_groups
from .sources import ended_together as ended_together
from .sources import torchrec_results as torchrec_results
from .staged import stage_tasks as stage_tasks
from .staged import staged_pipeline as staged_pipeline
from .sources import without_last_two as without_last_two
from .spec import SHARED_REWRITE as SHARED_REWRITE
from .spec import PipelineSpec as PipelineSpec
from .spec import check_pipelineable as check_pipelineable
from .tasks import SPARSE_DIST_THREAD_MAP as SPARSE_DIST_THREAD_MAP
from .tasks import ModelForward as ModelForward
from .tasks import SparseDistState as SparseDistState
from .tasks import StepLayout as StepLayout
from .tasks import build_sparse_dist_tasks as build_sparse_dist_tasks
from .tasks import embedding_lookup_task as embedding_lookup_task
from .tasks import finish_input_dist_splits as finish_input_dist_splits
from .tasks import pipelined_step_tasks as pipelined_step_tasks
from .tasks import training_tasks as training_tasks

__all__ = (
    "DLRM_PIPELINES",
    "SHARED_REWRITE",
    "SPARSE_DIST_THREAD_MAP",
    "STREAMS",
    "TRAIN_SCHEDULES",
    "AgreementGroups",
    "DLRMConfig",
    "DLRMRun",
    "InputDistNotPipelinedError",
    "InputDistNotPipelinedWarning",
    "ModelForward",
    "PipelineSpec",
    "PipelinedModel",
    "SparseDistBase",
    "SparseDistEvalPipeline",
    "SparseDistPipeline",
    "SourceWrappers",
    "SparseDistState",
    "StepLayout",
    "SyntheticDLRMData",
    "TrainSchedule",
    "agreement_groups",
    "build_dlrm_training",
    "build_sparse_dist_tasks",
    "carries_torchrec_rewrite",
    "check_pipelineable",
    "embedding_lookup_task",
    "ended_together",
    "evaluate_plainly",
    "finish_input_dist_splits",
    "fused",
    "input_dist_pipelined",
    "pipelined_step_tasks",
    "pt2",
    "run_dlrm",
    "semi_sync",
    "stage_tasks",
    "staged_pipeline",
    "stream_pool",
    "torchrec_results",
    "train_schedule",
    "training_tasks",
    "without_last_two",
)
