"""Checkpoints taken at a progress boundary, and finding the latest complete one.

Between two ``await pipe.progress(...)`` calls the state is simple: the model and
optimizers have applied exactly the steps whose results were returned, and the
batches still in flight have only been *prepared* (copied, shuffled, their input
distribution started) -- work that changes no persistent state.  So a checkpoint is
the training state plus one number, the data position ``step`` (results returned
so far); resuming re-reads the source from batch ``step``: no batch is lost, none is
applied twice.  (A schedule whose lookahead > 0 tasks change persistent state would
break this; none of the shipped ones do.)

Each checkpoint is a ``torch.distributed.checkpoint`` directory, so sharded state
(torchrec's sharded tables and their fused optimizer state) is saved and loaded by
every rank collectively.  It is written under a temporary name and renamed once
every rank has finished, so a crash mid-save leaves a partial directory that
:meth:`CheckpointManager.latest` ignores and the next save cleans up (a save that
fails removes its own).  Pruned checkpoints are renamed before they are deleted, so
a crash while pruning never leaves a broken one listed as complete.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ._checkpoint_files import (
    PARTIAL,
    fsync_directory,
    remove_checkpoint,
    remove_leftovers,
    shape_mismatch,
    step_of,
)
from ._core.log import checkpoint_log
from .errors import ConfigurationError, ConfigurationTypeError, PipelineError

__all__ = ("CheckpointError", "CheckpointManager", "materialize_optimizer_state")

_META = "aiopipe-meta.json"
#: The suffix of a checkpoint moved aside while a re-save of its step commits.
_ASIDE = ".replaced"


class CheckpointError(PipelineError):
    """A checkpoint could not be found, written or read back."""


class CheckpointManager:
    """Complete checkpoints ``step-00000042/`` under ``directory``, newest ``keep`` kept.

    Every rank of the default process group (or ``process_group``) must call
    :meth:`save`, :meth:`latest` and :meth:`load` together; the directory must be
    visible to all of them (one host, or a shared file system).
    """

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 2, process_group: Any = None
    ) -> None:
        self.keep = _whole_number("keep", keep, minimum=1)
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory} is a file, not a checkpoint directory")
        self._group = process_group

    # -- finding -----------------------------------------------------------------------

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints on disk, oldest first (none while the
        directory does not exist; :class:`CheckpointError` when it cannot be read)."""
        if not self.directory.exists():
            return []
        if not self.directory.is_dir():  # "no checkpoint" would restart the job from scratch
            raise CheckpointError(f"{self.directory} is a file, not a checkpoint directory")
        steps = []
        try:
            if self._rank() == 0:  # rank 0 alone renames
                self._recover()
            for entry in self.directory.iterdir():
                step = step_of(entry.name)
                if step is not None and (entry / _META).is_file():
                    steps.append(step)
        except OSError as exc:
            raise CheckpointError(f"the checkpoint directory cannot be read: {exc}") from exc
        return sorted(steps)

    def latest(self) -> int | None:
        """The newest complete checkpoint's step, agreed by every rank (rank 0 looks)."""
        found: int | CheckpointError | None = None
        if self._rank() == 0:
            try:
                steps = self.complete_steps()
            except CheckpointError as exc:  # raised on every rank, not on rank 0 alone
                found = exc
            else:
                found = steps[-1] if steps else None
        found = self._from_rank_zero(found)
        if isinstance(found, CheckpointError):
            raise found
        return found

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def _recover(self) -> None:
        """Put back a checkpoint moved aside by a re-save that crashed before its
        replacement got the name; drop it once the replacement is complete."""
        for aside in self.directory.glob(f"step-*{_ASIDE}"):
            final = self.directory / aside.name[: -len(_ASIDE)]
            if (final / _META).is_file():
                shutil.rmtree(aside, ignore_errors=True)
            elif (aside / _META).is_file():
                shutil.rmtree(final, ignore_errors=True)
                os.replace(aside, final)

    # -- writing -----------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any] | None = None) -> Path:
        """Write ``state`` (a nested dict of tensors, sharded tensors and plain objects)
        as the checkpoint of data position ``step``; ``meta`` is JSON kept beside it
        (rank 0's copy is the one written)."""
        step = _whole_number("step", step, minimum=0)
        refusal: PipelineError | None = None
        # Rank 0 writes the meta and prunes: its verdict holds for all.  The broadcast
        # also holds the other ranks back until the directory is ready.
        if self._rank() == 0:
            refusal = self._refusal(step, meta) or self._prepare()
        refusal = self._from_rank_zero(refusal)
        if refusal is not None:
            raise refusal
        final = self.path(step)
        partial = self.directory / f"{final.name}{PARTIAL}"
        try:
            from torch.distributed.checkpoint.state_dict_saver import save

            save(state, checkpoint_id=str(partial), process_group=self._group)
        except (Exception, CheckpointException) as exc:  # torch's is a BaseException
            # DCP raises on every rank once all have stopped writing: the partial is
            # no one's now, and kept it would hold the space a later save needs.
            if self._rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(
                f"saving the checkpoint of step {step} failed, its partial directory "
                f"removed: {_cause(exc)}"
            ) from exc
        self._barrier()  # every rank's shards are on disk
        failure: str | None = None
        error: BaseException | None = None
        if self._rank() == 0:
            try:
                self._commit(step, partial, final, meta)
            except BaseException as exc:  # tell the other ranks instead of leaving them waiting
                failure, error = f"{type(exc).__name__}: {exc}", exc
        failure = self._from_rank_zero(failure)
        if error is not None and not isinstance(error, Exception):
            raise error  # KeyboardInterrupt and the like stay what they are (peers told)
        if failure is not None:
            raise CheckpointError(
                f"committing the checkpoint of step {step} failed: {failure}"
            ) from error
        checkpoint_log.info("checkpoint of step %d saved in %s", step, final)
        return final

    def _refusal(self, step: int, meta: dict[str, Any] | None) -> PipelineError | None:
        """Why ``save(step, meta=meta)`` must not write anything, if it must not."""
        try:
            json.dumps(meta or {})
        except (TypeError, ValueError) as exc:
            return ConfigurationError(f"meta must be JSON-serialisable: {exc}")
        try:
            newer = [kept for kept in self.complete_steps() if kept > step]
        except CheckpointError as exc:
            return exc
        if len(newer) >= self.keep:
            return CheckpointError(
                f"step {step} is older than the {self.keep} checkpoint(s) kept "
                f"({', '.join(map(str, newer[-self.keep:]))}): it would be pruned at once"
            )
        return None

    def _prepare(self) -> CheckpointError | None:
        """Create the directory and drop what earlier saves left; what failed, if any."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only parent, a file on the path
            return CheckpointError(
                f"the checkpoint directory {self.directory} cannot be created: {exc}"
            )
        remove_leftovers(self.directory)  # a partial of another step holds disk space too
        return None

    def _commit(self, step: int, partial: Path, final: Path, meta: dict[str, Any] | None) -> None:
        body = {"step": step, "world_size": self._world_size(), "meta": meta or {}}
        with open(partial / _META, "w") as out:
            json.dump(body, out)
            out.flush()
            os.fsync(out.fileno())  # the metadata is durable before the name says complete
        # A checkpoint of the same step is moved aside, not deleted, until the new one
        # has its name: a crash in between leaves it to be put back (_recover).
        aside = self.directory / f"{final.name}{_ASIDE}"
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(partial, final)  # the commit point
        fsync_directory(self.directory)
        shutil.rmtree(aside, ignore_errors=True)
        self._prune()

    def _prune(self) -> None:
        """Delete checkpoints older than the newest ``keep``.  After the commit point: a
        failure here (a busy file on NFS) is logged, not reported as a failed save."""
        try:
            for old in self.complete_steps()[: -self.keep]:
                remove_checkpoint(self.path(old))
            remove_leftovers(self.directory)
        except (OSError, CheckpointError) as error:
            checkpoint_log.warning("pruning %s failed, the next save tries "
                                 "again: %s", self.directory, error)  # fmt: skip

    # -- reading -----------------------------------------------------------------------

    def load(
        self, step: int, state: dict[str, Any], *, any_world_size: bool = False
    ) -> dict[str, Any]:
        """Fill ``state`` in place from checkpoint ``step`` and return its ``meta``.

        ``state`` must have the saved structure with tensors allocated (build it from
        the freshly constructed model and optimizers; call
        :func:`materialize_optimizer_state` first for optimizers that create their
        state lazily).  A checkpoint written by another number of ranks is refused
        unless ``any_world_size``: then DCP reshards every tensor onto this job's
        layout, which is right only when the caller's data position is global (not
        per rank).  Tensors the checkpoint lacks (another optimizer's state) or whose
        global shapes differ from the saved ones are refused by name, before anything
        is loaded."""
        path = self.path(step)
        body = self.describe(step)
        saved_world = body.get("world_size")
        if not any_world_size and saved_world is not None and saved_world != self._world_size():
            raise CheckpointError(
                f"checkpoint {path.name} was written by {saved_world} ranks, this job has "
                f"{self._world_size()}: each rank's data position would not carry over "
                f"(load(..., any_world_size=True) when the data position is global)"
            )
        mismatch = shape_mismatch(path, state)
        if mismatch is not None:
            raise CheckpointError(f"checkpoint {path.name} does not fit this model: {mismatch}")
        try:
            from torch.distributed.checkpoint.state_dict_loader import load

            load(state, checkpoint_id=str(path), process_group=self._group,
                 planner=_resharding_planner())  # fmt: skip
        except (Exception, CheckpointException) as exc:  # torch's is a BaseException
            raise CheckpointError(f"loading the checkpoint of step {step} failed: {exc}") from exc
        checkpoint_log.info("resuming from the checkpoint of step %d in %s", step, path)
        return dict(body.get("meta", {}))

    def describe(self, step: int) -> dict[str, Any]:
        """Checkpoint ``step``'s record without loading it: ``step``, ``world_size``
        (the ranks that wrote it) and ``meta`` -- e.g. to size this job's batches
        before building the state to load into."""
        meta_file = self.path(step) / _META
        if not meta_file.is_file():
            raise CheckpointError(f"no complete checkpoint at {self.path(step)}")
        try:
            body = json.loads(meta_file.read_text())
        except (OSError, ValueError) as exc:  # truncated, emptied, unreadable
            raise CheckpointError(f"{meta_file} cannot be read: {exc}") from exc
        if not isinstance(body, dict):
            raise CheckpointError(f"{meta_file} holds no checkpoint record")
        return body

    # -- process group -----------------------------------------------------------------

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _rank(self) -> int:
        return dist.get_rank(self._group) if self._distributed() else 0

    def _world_size(self) -> int:
        return dist.get_world_size(self._group) if self._distributed() else 1

    def _global_rank_zero(self) -> int:
        if self._group is None:
            return 0
        return int(dist.get_global_rank(self._group, 0))

    def _from_rank_zero(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        if not self._distributed():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self._global_rank_zero(), group=self._group)
        return box[0]

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier(group=self._group)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, keep={self.keep})"


def _resharding_planner() -> Any:
    """DCP's default load planner without its guess at pre-2.4 checkpoints.

    When a rank's state lacks keys the checkpoint has -- under a table-wise plan each
    rank holds only its own tables' optimizer state -- the guess takes the
    checkpoint for an old one, re-flattens the state the old way and then asks for
    keys (``...param_groups``) that exist in neither.  Keys the checkpoint has and
    this rank does not are simply not read; keys this rank has and the checkpoint
    lacks are still refused."""
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        create_default_local_load_plan,
    )
    from torch.distributed.checkpoint.planner import LoadPlan

    class ReshardingLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            if self.metadata is None:
                raise CheckpointError("the checkpoint's metadata was not read")
            return create_default_local_load_plan(
                self.state_dict, self.metadata, not self.allow_partial_load
            )

    return ReshardingLoadPlanner()


def _whole_number(what: str, value: object, *, minimum: int) -> int:
    """``value`` as an int ``>= minimum``: ``1.5`` would name a checkpoint no one finds,
    ``True`` one of step 1.  NumPy's ints are accepted (and made plain for JSON)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigurationTypeError(f"{what} takes an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ConfigurationError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


def _cause(exc: BaseException) -> str:
    """What failed, said in one line: torch's ``CheckpointException`` starts with the
    failed ranks only, the cause (``No space left on device``) deep in a traceback."""
    if isinstance(exc, CheckpointException) and exc.failures:
        rank = min(exc.failures)
        cause = exc.failures[rank][0]
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    return f"{type(exc).__name__}: {exc}"


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the lazily-made state of a ``torch.optim`` optimizer (Adam's moments,
    momentum buffers) without changing any parameter, so a checkpoint can be loaded
    into it: one step with zero gradients at learning rate 0 (empty sparse gradients
    for ``SparseAdam``).  An optimizer that cannot take that step -- ``LBFGS``, whose
    step needs a closure and whose state is a history of varying length -- raises
    :class:`CheckpointError` naming it."""
    name = type(optimizer).__name__
    if optimizer.state:
        return
    if isinstance(optimizer, torch.optim.LBFGS):  # torch: "missing ... 'closure'"
        raise CheckpointError(
            f"materialize_optimizer_state cannot prepare {name}: its step needs a closure "
            f"and its state is a history of varying length, which no state built "
            f"beforehand matches"
        )
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise CheckpointError("materialize_optimizer_state needs parameters without gradients")
    saved_lrs = [group.get("lr") for group in optimizer.param_groups]
    sparse = isinstance(optimizer, torch.optim.SparseAdam)  # it refuses dense gradients
    for p in params:
        p.grad = _no_rows(p) if sparse else torch.zeros_like(p)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    except Exception as exc:  # a bare TypeError/RuntimeError would not say what was asked
        raise CheckpointError(
            f"materialize_optimizer_state cannot prepare {name}: a step with zero gradients "
            f"failed ({type(exc).__name__}: {exc})"
        ) from exc
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _no_rows(parameter: torch.Tensor) -> torch.Tensor:
    """A sparse gradient of ``parameter`` with no rows: SparseAdam creates its state
    and changes nothing.  Invariants are named so that torch does not warn."""
    indices = torch.empty((1, 0), dtype=torch.long, device=parameter.device)
    values = parameter.new_empty((0, *parameter.shape[1:]))
    return torch.sparse_coo_tensor(indices, values, parameter.shape, check_invariants=False)
