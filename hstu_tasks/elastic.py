"""Resizing a job: the global batch rule, the record of the samples consumed, and the
resumable side of a training script (:class:`ResumableJob`, which both examples use).

A job that resumes on another number of ranks keeps its data position global: the
samples consumed, in one global order (``SyntheticHSTUData(..., world_size=...)``,
``SyntheticDLRMData(..., world_size=...)``).  Each rank's share of the next global
batch follows from that position and the current world size, so nothing is skipped
or trained twice across a resize -- a resize by hand, or torchrun's elastic restart
when a node leaves or joins (docs/fault-tolerance.md).  :class:`FaultInjection` holds
the forced points the tests of both use.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch.distributed as dist

from aiopipe.checkpoint import CheckpointError

from .arguments import at_least, pair, seconds
from .checkpoint import JobCheckpoints

__all__ = (
    "FaultInjection",
    "GlobalSamples",
    "ResumableJob",
    "SampleLedger",
    "rank_batch_size",
    "resolve_global_batch",
)

BatchT_co = TypeVar("BatchT_co", covariant=True)


class GlobalSamples(Protocol[BatchT_co]):
    """A rank's batches cut from one global sample order (the synthetic data sets
    given a ``world_size``)."""

    def __len__(self) -> int: ...

    def sample_ids(self, index: int) -> range: ...

    def batch(self, index: int) -> BatchT_co: ...


def rank_batch_size(global_batch_size: int, world_size: int) -> int:
    """Each rank's batch when ``world_size`` ranks share a global batch: refused when
    it does not divide (uneven shares would weigh the ranks' samples differently
    under DDP's gradient mean and change the optimisation)."""
    if global_batch_size < 1 or world_size < 1:
        raise ValueError(
            f"global batch size and world size must be >= 1, got {global_batch_size} and "
            f"{world_size}"
        )
    if global_batch_size % world_size:
        raise ValueError(
            f"the global batch size {global_batch_size} does not divide into {world_size} "
            f"equal rank batches: pick a multiple of {world_size}, or keep the per-rank batch "
            f"instead (the examples' --keep-rank-batch; it changes the global batch, hence "
            f"the optimisation)"
        )
    return global_batch_size // world_size


class SampleLedger(Generic[BatchT_co]):
    """The global sample ids of the batches a rank's source yielded, folded -- once
    applied -- into a SHA-256 chained sample by sample in global order.

    Chaining per sample (``d = sha256(d || id)``) makes the digest depend on the
    ordered ids only, not on how they were cut into batches or ranks, and keeps it a
    hex string a checkpoint can carry across a resize.
    """

    def __init__(self, data: GlobalSamples[BatchT_co], digest: str = "") -> None:
        self.data = data
        self.digest = digest
        self._yielded: list[range] = []
        self._folded = 0

    def source(self) -> Iterator[BatchT_co]:
        """``data``'s batches, each one's ids noted as it is taken."""
        for index in range(len(self.data)):
            self._yielded.append(self.data.sample_ids(index))
            yield self.data.batch(index)

    def fold(self, applied: int) -> str:
        """Fold the ids of batches up to ``applied`` (this run's applied steps) into
        the digest and return it.  A collective: every rank calls it at the same
        progress boundary (the ranks' ids are gathered to interleave them)."""
        mine = [list(ids) for ids in self._yielded[self._folded : applied]]
        if len(mine) != applied - self._folded:
            raise ValueError(f"{applied} steps applied but only {len(self._yielded)} batches taken")
        shares: list[list[list[int]]] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            shares = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(shares, mine)
        digest = bytes.fromhex(self.digest)
        for step in range(len(mine)):
            for rank_share in shares:  # rank r holds part r of the global batch
                for sample in rank_share[step]:
                    digest = hashlib.sha256(digest + sample.to_bytes(8, "little")).digest()
        self.digest = digest.hex()
        self._folded = applied
        return self.digest


def resolve_global_batch(
    *, requested: int | None, rank_batch: int, keep_rank_batch: bool, world_size: int,
    saved: Mapping[str, Any],
) -> int:  # fmt: skip
    """The samples per step over all ranks: ``requested`` when given, else the
    checkpoint's (kept across a resize), else ``rank_batch`` x ``world_size``.
    ``keep_rank_batch`` keeps ``rank_batch`` per rank instead, which changes the
    global batch (and the optimisation) on a resize.  A request that contradicts the
    checkpoint is refused: it would silently change the optimisation too."""
    if keep_rank_batch:
        if requested is not None:
            raise ValueError(
                f"--keep-rank-batch keeps --batch-size ({rank_batch}) per rank, so the global "
                f"batch follows from the world size: drop --global-batch-size {requested}"
            )
        return rank_batch * world_size
    saved_global = saved.get("global_batch_size")
    if requested is not None:
        if saved_global is not None and saved_global != requested:
            raise ValueError(
                f"the checkpoint was trained with global batch {saved_global}, not "
                f"{requested}: pass --global-batch-size {saved_global}, or --keep-rank-batch "
                f"--batch-size B to train B samples per rank from here on"
            )
        return requested
    return int(saved_global) if isinstance(saved_global, int) else rank_batch * world_size


class FaultInjection:
    """Forced points for the tests of resumed and resized jobs (the examples'
    ``--kill-at``, ``--hold-at`` and ``--events``), called after each step once it is
    checkpointed.

    ``kill_at`` ``(rank, step)``: that rank SIGKILLs itself after that step, on the
    first attempt only (torchrun's restart then resumes).  ``hold_at`` ``{(step,
    world_size)}``: after that step in a group of that many ranks, every rank records
    ``held`` and waits for the file ``release-STEP-WORLD`` in ``events`` (a test kills
    what it wants meanwhile).  ``events``: a directory whose ``events.jsonl`` gets one
    line per ``started`` (with the step resumed from), first ``step`` and ``held``
    event, with the wall time, rank, world size, pid and the parent's pid (torchrun's
    agent)."""

    def __init__(self, *, rank: int, world_size: int, kill_at: tuple[int, int] | None = None,
                 hold_at: frozenset[tuple[int, int]] = frozenset(),
                 events: str | None = None) -> None:  # fmt: skip
        if hold_at and events is None:
            raise ValueError("hold_at needs an events directory (its release files are there)")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.rank, self.world_size = rank, world_size
        #: The step after which a rank kills itself (the same on every rank: they all
        #: end a call there, see :meth:`stops`), and whether this rank is the one.
        self.kill_step = kill_at[1] if kill_at and first_attempt else None
        self.kill_after = self.kill_step if kill_at and kill_at[0] == rank else None
        self.hold_at, self.events = hold_at, Path(events) if events else None
        self._stepped = False

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """``--kill-at``, ``--hold-at`` and ``--events``, for :meth:`from_args`."""
        parser.add_argument("--kill-at", metavar="RANK:STEP", type=pair,
                            help="for tests: SIGKILL rank RANK right after step STEP, on the "
                                 "first attempt only (torchrun restarts it)")
        parser.add_argument("--hold-at", metavar="STEP:WORLD", action="append", type=pair,
                            help="for tests: after step STEP in a group of WORLD ranks, wait "
                                 "for the file release-STEP-WORLD in the --events directory")
        parser.add_argument("--events", metavar="DIR",
                            help="for tests: append started/step/held events to "
                                 "DIR/events.jsonl")

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, rank: int, world_size: int) -> FaultInjection:
        """From the flags of :meth:`add_arguments` (argparse refused malformed ones)."""
        return cls(rank=rank, world_size=world_size, kill_at=args.kill_at,
                   hold_at=frozenset(args.hold_at or ()), events=args.events)  # fmt: skip

    def stops(self) -> list[int]:
        """The steps every rank must end a call on: where a rank kills itself or they
        hold (:meth:`after_step` sees each step it is handed, not the ones between,
        and the ranks' call ends must agree: each one's ``after_step`` may gather)."""
        held = [step for step, world in self.hold_at if world == self.world_size]
        return held + ([self.kill_step] if self.kill_step is not None else [])

    def record(self, event: str, **fields: Any) -> None:
        """An event line in ``events.jsonl`` (nothing without ``events``)."""
        if self.events is None:
            return
        line = json.dumps({"event": event, "time": time.time(), "rank": self.rank,
                           "world_size": self.world_size, "pid": os.getpid(),
                           "parent_pid": os.getppid(), **fields})  # fmt: skip
        with open(self.events / "events.jsonl", "a") as out:  # one short append: atomic
            out.write(line + "\n")

    def after_step(self, position: int) -> None:
        """Step ``position`` of the job is trained (and checkpointed when due)."""
        if not self._stepped:
            self._stepped = True
            self.record("step", step=position)
        if self.kill_after == position:
            os.kill(os.getpid(), signal.SIGKILL)
        if (position, self.world_size) in self.hold_at and self.events is not None:
            self.record("held", step=position)
            release = self.events / f"release-{position}-{self.world_size}"
            while not release.exists():  # a test's gate, polled: it may kill us instead
                time.sleep(0.05)


#: Steps between two checkpoints when ``--checkpoint-every`` is not given.
CHECKPOINT_EVERY = 10


class ResumableJob(Generic[BatchT_co]):
    """The resumable side of a training script, shared by the examples: the global
    batch and each rank's share of it, the checkpoints (``--checkpoint-dir``), the
    job's history carried through them, and the forced points of the tests.

    Every rank builds one after joining the group, :meth:`restore`\\ s it into the
    freshly built model, reads its data through :meth:`source`, calls
    :meth:`after_step` at each progress boundary and :meth:`samples_digest` at the
    end (the last three are collectives where checkpoints are involved)."""

    def __init__(self, args: argparse.Namespace, *, rank: int, world_size: int) -> None:
        """From the flags of :meth:`add_arguments` and the script's ``--batch-size``;
        a global batch that cannot be kept exits with the reason (on every rank
        alike: they read the same checkpoint)."""
        self.rank, self.world_size = rank, world_size
        every = args.checkpoint_every or CHECKPOINT_EVERY
        try:
            self.checkpoints = (JobCheckpoints(args.checkpoint_dir, every)
                                if args.checkpoint_dir else None)  # fmt: skip
        except CheckpointError as error:  # a record that cannot be read, a file, ...
            raise SystemExit(f"{Path(sys.argv[0]).name}: {error}") from None
        if args.checkpoint_every is not None and not args.checkpoint_dir and rank == 0:
            print(f"{Path(sys.argv[0]).name}: note: --checkpoint-every writes nothing without "
                  f"--checkpoint-dir", file=sys.stderr)  # fmt: skip
        try:
            self.global_batch = resolve_global_batch(
                requested=args.global_batch_size, rank_batch=args.batch_size,
                keep_rank_batch=args.keep_rank_batch, world_size=world_size,
                saved=self.checkpoints.saved if self.checkpoints else {},
            )  # fmt: skip
            self.rank_batch = rank_batch_size(self.global_batch, world_size)
        except ValueError as error:
            raise SystemExit(f"{Path(sys.argv[0]).name}: {error}") from None
        self.faults = FaultInjection.from_args(args, rank=rank, world_size=world_size)
        self.total_steps = int(args.steps)  # the job's last step is checkpointed too
        self.start: int = 0
        self.meta: dict[str, Any] = {}
        self.ledger: SampleLedger[BatchT_co] | None = None

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """``--global-batch-size``, ``--keep-rank-batch``, ``--checkpoint-dir``,
        ``--checkpoint-every``, ``--collective-timeout`` and the fault injection's."""
        parser.add_argument("--global-batch-size", type=at_least(1), metavar="G",
                            help="samples per step over all ranks: each rank trains G / world "
                                 "size (default: --batch-size x world size, or the "
                                 "checkpoint's)")
        parser.add_argument("--keep-rank-batch", action="store_true",
                            help="on a resize keep --batch-size per rank instead of the global "
                                 "batch: the global batch changes, and so does the optimisation")
        parser.add_argument("--checkpoint-dir", metavar="DIR",
                            help="checkpoint here and resume from the newest complete checkpoint "
                                 "(written by any number of ranks)")
        parser.add_argument("--checkpoint-every", type=at_least(1), metavar="N",
                            help=f"with --checkpoint-dir: a checkpoint every N steps "
                                 f"(default: {CHECKPOINT_EVERY})")
        parser.add_argument("--collective-timeout", type=seconds, default=300.0, metavar="SECONDS",
                            help="a collective waiting longer than this fails the run (a peer "
                                 "died or hangs) instead of hanging it")
        FaultInjection.add_arguments(parser)

    def restore(self, setup: Any) -> None:
        """Load the newest checkpoint into ``setup``, resharded onto this job's ranks
        (its data position is global); a checkpoint that does not fit exits with the
        reason, naming the tensor."""
        try:
            self.start, self.meta = self.checkpoints.restore(setup) if self.checkpoints else (0, {})
        except CheckpointError as error:
            raise SystemExit(f"{Path(sys.argv[0]).name}: {error}") from None
        self.faults.record("started", step=self.start)

    @property
    def samples_consumed(self) -> int:
        """Where this run's data starts in the global sample order."""
        return int(self.meta.get("samples_consumed", self.start * self.global_batch))

    @property
    def earlier_losses(self) -> list[float]:
        """The per-step global losses of the steps before this run."""
        return list(self.meta.get("losses", []))

    def resumed_note(self) -> str:
        """``", resuming after step N (written by M ranks, resharded)"``, or ``""``."""
        if not self.start:
            return ""
        note = f", resuming after step {self.start}"
        written = self.checkpoints.saved_world_size if self.checkpoints else None
        if written is not None and written != self.world_size:
            note += f" (written by {written} rank{'s' * (written != 1)}, resharded)"
        return note

    def nothing_ran_note(self) -> str:
        """What a run that trained no step reports: its job was finished already, it
        had no steps, or its data ended before the first."""
        if self.start:
            return (f"nothing left to run: the checkpoint is at step {self.start} of "
                    f"{self.total_steps}")  # fmt: skip
        if self.total_steps:
            return f"no steps run: the data ended before the first of {self.total_steps}"
        return "no steps run (--steps 0)"

    def source(self, data: GlobalSamples[BatchT_co]) -> Iterator[BatchT_co]:
        """``data``'s batches, their samples noted for the digest."""
        self.ledger = SampleLedger(data, self.meta.get("samples_sha256", ""))
        return self.ledger.source()

    def after_step(self, step: int, setup: Any, losses: Callable[[], list[float]]) -> None:
        """This run's ``step``-th step is applied: checkpoint it when due, or when it is
        the job's last (``losses()``: this run's per-step global losses, a collective),
        and pass the forced points."""
        position = self.start + step
        if self.checkpoints is not None:
            self.checkpoints.save_if_due(
                position, setup, last=position == self.total_steps,
                losses=self.earlier_losses + losses(),
                global_batch_size=self.global_batch,
                samples_consumed=self.samples_consumed + step * self.global_batch,
                samples_sha256=lambda: self.samples_digest(step),
            )  # fmt: skip
        self.faults.after_step(position)

    def steps_for_call(self, step: int, wanted: int) -> int:
        """How many steps to ask for in the call after this run's ``step``-th
        (``progress_many``): ``wanted``, cut so that the call ends on the next step
        :meth:`after_step` must see by itself -- a checkpoint (the same on every rank)
        or a forced point."""
        position = self.start + step
        stops = [stop - position for stop in self.faults.stops() if stop > position]
        if self.checkpoints is not None:
            stops.append(self.checkpoints.every - position % self.checkpoints.every)
        return min([wanted, *stops])

    def samples_digest(self, steps: int) -> str:
        """The SHA-256 of the global samples consumed by the job up to this run's
        ``steps``-th step (a collective)."""
        if self.ledger is None:
            raise RuntimeError("samples_digest() before source()")
        return self.ledger.fold(steps)
