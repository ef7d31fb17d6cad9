"""Worker functions for the two-rank sparse-dist pipeline tests (spawned processes
import this)."""

from __future__ import annotations

import asyncio
import faulthandler
import itertools
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import collect
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.runtime_forwards import BaseForward
from torchrec.distributed.train_pipeline.runtime_forwards import PrefetchPipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TorchCompileConfig
from torchrec.distributed.types import ShardedModule

from aiopipe import AsyncExecutor, BadBatchError, CollectiveOrderError, PipelineStateError
from aiopipe import SequentialExecutor
from hstu_tasks import join_local_group, leave_and_exit, quiet_torchrec
from hstu_tasks.runners import parameter_digest
from hstu_tasks.sparse.agreement import WINDOW, EndedTogether
from hstu_tasks.sparse.dlrm import DLRMConfig, SyntheticDLRMData, build_dlrm_training
from hstu_tasks.sparse.dlrm_runs import run_dlrm
from hstu_tasks.sparse.pipeline import SparseDistEvalPipeline, SparseDistPipeline
from hstu_tasks.sparse.schedules import train_schedule
from hstu_tasks.sparse.sources import torchrec_results

CONFIG = DLRMConfig(num_embeddings=200, batch_size=16)
STEPS = 6


def spawn(worker: object, *args: object) -> None:
    """Run ``worker(rank, port, *args)`` on two ranks (each joins with :func:`join`)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(port, *args), nprocs=2, join=True)  # type: ignore[arg-type]


def join(rank: int, port: int) -> None:
    faulthandler.enable()
    quiet_torchrec()
    join_local_group(rank, 2, port)


def data(rank: int, batches: int = STEPS, seed: int = 5) -> SyntheticDLRMData:
    return SyntheticDLRMData(CONFIG, batches, seed=seed, rank=rank)


def runs_rewritten(model: torch.nn.Module) -> bool:
    """Whether torchrec's pipelined forwards are installed on the sharded modules."""
    sharded = [m for m in model.modules() if isinstance(m, ShardedModule)]
    assert sharded
    return all(isinstance(m.forward, BaseForward) for m in sharded)


def scaled_loss(batch: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    loss, output = model(batch)
    return loss * 2, output


def equality_worker(rank: int, port: int) -> None:
    join(rank, port)
    for kind in ("sgd", "adagrad"):
        check_equality(rank, kind)
    leave_and_exit(0)


def check_equality(rank: int, kind: str) -> None:
    """The generic pipeline (async, blocking, and progress_many) trains like torchrec's
    pipeline and the plain loop, bit for bit; so do their custom_model_fwd and
    execute_all_batches=False forms."""
    outcomes = {}
    for mode in ("none", "torchrec", "aiopipe"):
        setup = build_dlrm_training(CONFIG, kind, seed=3)
        run = run_dlrm(mode, setup, [data(rank)])
        outcomes[mode] = (run.global_losses(), parameter_digest(setup.model))
    setup = build_dlrm_training(CONFIG, kind, seed=3)
    blocking = SparseDistPipeline(setup.model, setup.optimizer, setup.device).blocking()
    source = iter(data(rank))
    losses = [float(loss) for loss, _, _ in blocking.results(source)]
    with pytest.raises(StopIteration):  # torchrec's contract, again and again
        blocking.progress(source)
    assert runs_rewritten(setup.model)  # two ranks: the input dist runs a batch ahead
    blocking.shutdown()
    outcomes["aiopipe-blocking"] = (_mean_over_ranks(losses), parameter_digest(setup.model))
    # Steps asked for four at a time: the lanes chain them, tickets and all.
    setup = build_dlrm_training(CONFIG, kind, seed=3)
    blocking = SparseDistPipeline(setup.model, setup.optimizer, setup.device).blocking()
    source, losses = iter(data(rank)), []
    while results := blocking.progress_many(source, 4):
        losses += [float(loss) for loss, _, _ in results]
    blocking.shutdown()
    outcomes["aiopipe-progress-many"] = (_mean_over_ranks(losses), parameter_digest(setup.model))
    assert len(outcomes["none"][0]) == STEPS
    for mode, outcome in outcomes.items():
        assert outcome == outcomes["none"], (kind, mode)

    # custom_model_fwd and execute_all_batches=False, against torchrec's own
    variants = {}
    for name in ("torchrec", "aiopipe"):
        setup = build_dlrm_training(CONFIG, kind, seed=3)
        pipeline = TrainPipelineSparseDist if name == "torchrec" else SparseDistPipeline
        pipe = pipeline(setup.model, setup.optimizer, setup.device, False,  # type: ignore[operator]
                        custom_model_fwd=lambda batch, m=setup.model: scaled_loss(batch, m))
        if name == "aiopipe":
            pipe = pipe.blocking()
        source = iter(data(rank))
        losses = [float(loss) for loss, _, _ in _until_stop(pipe, source)]
        assert len(losses) == STEPS - 2  # the last two batches are dropped
        assert next(source, None) is None  # ... after being read
        variants[name] = (losses, parameter_digest(setup.model))
        if name == "aiopipe":
            pipe.shutdown()
    assert variants["aiopipe"] == variants["torchrec"], kind


def _until_stop(pipe: Any, source: Any) -> list[Any]:
    results = []
    while True:
        try:
            results.append(pipe.progress(source))
        except StopIteration:
            return results


def _mean_over_ranks(losses: list[float]) -> list[float]:
    values = torch.tensor(losses, dtype=torch.float64)
    torch.distributed.all_reduce(values)
    return (values / 2).tolist()  # type: ignore[no-any-return]


def loader(dataset: SyntheticDLRMData) -> torch.utils.data.DataLoader[Any]:
    # fork: this rank was started by spawn, whose workers would import torchrec anew
    return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1,
                                       persistent_workers=True, multiprocessing_context="fork")


def eval_worker(rank: int, port: int) -> None:
    join(rank, port)
    check_interleaving(rank)
    check_contract(rank)
    leave_and_exit(0)


def check_interleaving(rank: int) -> None:
    """Three epochs from a persistent-worker loader (one iterator object, reset by
    each iter()), evaluation passes mid-epoch (from another persistent loader) and
    after each epoch (a different length each time), on both ranks at the same steps:
    every evaluation output equals a plain model.eval() forward of its batch at that
    point, and training is the one a run without the evaluation passes does."""
    train_loader, eval_loader = loader(data(rank, 5)), loader(data(rank, 3, seed=8))
    first = iter(train_loader)
    assert iter(train_loader) is first  # what torchrec's identity check trips over

    def eval_after(step: int) -> Any:
        epoch, position = divmod(step - 1, 5)
        if position == 1:
            return eval_loader
        if position == 4:  # after the epoch: 2, 3 then 4 batches
            return data(rank, 2 + epoch, seed=9 + epoch)
        return None

    runs = {}
    for mode, plan in [("none", eval_after), ("aiopipe", eval_after),
                       ("aiopipe-fused", eval_after),  # evaluation looks embeddings up too
                       ("aiopipe-semi-sync", eval_after),  # synchronous before step 900
                       ("aiopipe-prefetch", eval_after),  # evaluation prefetches too
                       ("aiopipe-no-eval", lambda step: None)]:  # fmt: skip
        setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
        run = run_dlrm(mode.removesuffix("-no-eval"), setup, [train_loader] * 3, plan)  # type: ignore[arg-type]
        runs[mode] = (run, parameter_digest(setup.model))
    reference, _ = runs["none"]
    assert len(reference.losses) == 15
    assert [len(outputs) for outputs in reference.evaluations] == [3, 2, 3, 3, 3, 4]
    for mode, (run, digest) in runs.items():
        assert (run.losses, digest) == (reference.losses, runs["none"][1]), mode
    for evaluated, _ in (runs["aiopipe"], runs["aiopipe-fused"], runs["aiopipe-semi-sync"],
                         runs["aiopipe-prefetch"]):  # fmt: skip
        assert len(evaluated.evaluations) == len(reference.evaluations)
        for got, expected in zip(evaluated.evaluations, reference.evaluations):
            assert len(got) == len(expected)
            for got_output, expected_output in zip(got, expected):  # (loss, logits, labels)
                assert all(torch.equal(a, b) for a, b in zip(got_output, expected_output))
    assert runs["aiopipe-no-eval"][0].evaluations == []


def check_contract(rank: int) -> None:
    """Refusals and the lifetime of a train and an eval pipeline on one model."""
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
    evaluator = SparseDistEvalPipeline(setup.model, None, setup.device)  # shares the rewrite
    with pytest.raises(ValueError, match="device"):
        SparseDistEvalPipeline(setup.model, None, "meta")

    async def scenario() -> None:
        with pytest.raises(BadBatchError, match="Pipelineable"):  # refused before tracing
            await pipe.progress(iter([{"not": "a batch"}]))
        source = iter(data(rank))
        await pipe.progress(source)
        assert len(pipe._state.pipelined_modules) == 1  # torchrec rewrote the collection
        with pytest.raises(PipelineStateError, match="in flight"):
            pipe.detach()
        # the pipelines of one model take turns
        eval_source = iter(data(rank, 3, seed=7))
        outcomes = await asyncio.gather(pipe.progress(source), evaluator.progress(eval_source),
                                        return_exceptions=True)  # fmt: skip
        assert isinstance(outcomes[1], PipelineStateError) and "take turns" in str(outcomes[1])
        assert next(eval_source) is not None  # the refused call took nothing
        # the eval pipeline runs beside the two training batches in flight
        before = parameter_digest(setup.model)
        assert len(await collect(evaluator, iter(data(rank, 3, seed=7)))) == 3
        assert parameter_digest(setup.model) == before and setup.model.training
        assert len(await collect(pipe, source)) == STEPS - 2
        with pytest.raises(StopAsyncIteration):  # a plain iterator stays ended
            await pipe.progress(source)
        model = pipe.detach()  # both pipelines' engines are gone, the forwards restored
        assert evaluator.engine is None and pipe.engine is None
        loss, _ = model(data(rank)[0].to(setup.device))
        assert loss.dim() == 0
        with pytest.raises(PipelineStateError, match="detached"):
            await evaluator.progress(iter(data(rank)))
        pipe.attach()
        assert len(await collect(evaluator, iter(data(rank, 2)))) == 2  # traces it again
        assert len(await collect(pipe, iter(data(rank)))) == STEPS
        # torchrec's rule: the training pipeline runs a model in eval mode forward only
        setup.model.eval()
        before = parameter_digest(setup.model)
        forwarded = await collect(pipe, iter(data(rank, 3, seed=7)))
        setup.model.train()
        assert parameter_digest(setup.model) == before
        evaluated = await collect(evaluator, iter(data(rank, 3, seed=7)))
        assert all(torch.equal(a, b) for x, y in zip(forwarded, evaluated) for a, b in zip(x, y))
        await evaluator.aclose()
        await pipe.aclose()

    asyncio.run(scenario())


def uneven_batches_worker(rank: int, port: int) -> None:
    """12 batches on rank 0, 9 on rank 1, with the collective order check on: both
    ranks raise CollectiveOrderError before the first mismatched collective (at
    iteration 9, where rank 1 has no new batch), not a gloo failure."""
    join(rank, port)
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, end_together=False,
                              executor=AsyncExecutor(check_collective_order=1))  # fmt: skip

    async def train() -> int:
        async with pipe:
            return len(await collect(pipe, iter(data(rank, (12, 9)[rank]))))

    expected = (r"at iteration 9:\n  rank 0: batches 7-9, .*\n  rank 1: batches 7-8, .*\n"
                r"The ranks are on different batches")
    with pytest.raises(CollectiveOrderError, match=expected):
        asyncio.run(train())
    leave_and_exit(0)


#: Batches on each rank in the uneven-ranks checks: the shorter rank's source ends
#: the epoch for both.
UNEVEN = (10, 7)


def end_together_worker(rank: int, port: int) -> None:
    join(rank, port)
    for schedule in ("sparse-dist", "lite", "base", "fused", "semi-sync"):
        check_ending_together(rank, schedule)
    # The shorter source ends inside a window (1 + 2, then 2 of a window of 4): the
    # longer rank drops the two it read beyond.
    check_ending_together(rank, "sparse-dist", uneven=(20, 5))
    check_evaluation_ending_together(rank)
    check_an_eval_pass_while_a_training_pull_waits(rank)
    check_a_source_raising_on_one_rank(rank)
    leave_and_exit(0)


def check_a_source_raising_on_one_rank(rank: int) -> None:
    """Rank 0's source raises at its fourth batch: rank 0 raises that error and rank 1
    PipelineStateError, in the same call, and neither waits for the other."""

    def failing(items: Any) -> Any:
        for index, item in enumerate(items):
            if index == 3:
                raise ValueError("the loader failed")
            yield item

    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
    source = iter(data(rank, UNEVEN[0]))
    source = failing(source) if rank == 0 else source
    outputs: list[Any] = []

    async def train() -> None:
        async with pipe:
            while True:
                outputs.append(await pipe.progress(source))

    expected = (ValueError, "the loader failed") if rank == 0 else (
        PipelineStateError, "another rank's source raised")  # fmt: skip
    with pytest.raises(expected[0], match=expected[1]):
        asyncio.run(train())
    assert len(outputs) == 1  # the fourth batch is read two steps ahead, in the second call
    check_going_on_after_one_rank_raised(rank)


class RaisingOnce:
    """The items, but the fourth read raises once; read again, it goes on."""

    def __init__(self, items: list[Any]) -> None:
        self.items, self.read, self.raised = items, 0, False

    def __iter__(self) -> RaisingOnce:
        return self

    def __next__(self) -> Any:
        if self.read == 3 and not self.raised:
            self.raised = True
            raise ValueError("the loader failed once")
        if self.read == len(self.items):
            raise StopIteration
        self.read += 1
        return self.items[self.read - 1]


def check_going_on_after_one_rank_raised(rank: int) -> None:
    """Rank 0's source raises once and goes on; both ranks call again with the same
    source: they go on in step, and rank 1 trains the item it had read when rank 0
    raised (it was dropped, and the ranks then trained different batches)."""
    batches = data(rank, UNEVEN[1])
    plain = build_dlrm_training(CONFIG, "sgd", seed=3)
    reference = SparseDistPipeline(plain.model, plain.optimizer, plain.device)
    assert len(asyncio.run(_collect_in(reference, iter(batches)))) == len(batches)
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
    source = RaisingOnce(batches) if rank == 0 else iter(batches)
    errors: list[str] = []

    async def train() -> int:
        steps = 0
        async with pipe:
            while True:
                try:
                    await pipe.progress(source)
                    steps += 1
                except StopAsyncIteration:
                    return steps
                except (ValueError, PipelineStateError) as exc:
                    errors.append(str(exc))

    assert asyncio.run(train()) == len(batches)
    assert len(errors) == 1 and ("once" if rank == 0 else "item is kept") in errors[0]
    assert parameter_digest(setup.model) == parameter_digest(plain.model)


async def _async_items(items: Any) -> Any:
    for item in items:
        yield item


def check_ending_together(rank: int, schedule: str, uneven: tuple[int, int] = UNEVEN) -> None:
    """Rank 0 has 10 batches, rank 1 has 7 (``uneven``): both train 7 steps and end
    the epoch together (no collective left waiting), async and blocking, sync and
    async sources, and train exactly as a run with 7 batches on each rank does."""
    even = build_dlrm_training(CONFIG, "sgd", seed=3)
    pipe = SparseDistPipeline(even.model, even.optimizer, even.device, schedule=schedule)
    assert len(asyncio.run(_collect_in(pipe, iter(data(rank, uneven[1]))))) == uneven[1]
    expected = parameter_digest(even.model)
    for form in ("async", "blocking", "async source"):
        setup = build_dlrm_training(CONFIG, "sgd", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, schedule=schedule)
        source = iter(data(rank, uneven[rank]))
        if form == "blocking":
            blocking = pipe.blocking()
            outputs = list(torchrec_results(blocking, source))
            blocking.shutdown()
        elif form == "async source":
            outputs = asyncio.run(_collect_in(pipe, _async_items(source)))
        else:
            outputs = asyncio.run(_collect_in(pipe, source))
        assert len(outputs) == uneven[1], (schedule, form)
        assert parameter_digest(setup.model) == expected, (schedule, form)
        # the longer rank read to the end of the window past the common end, no further
        assert len(list(source)) == uneven[rank] - read_by_the_end(uneven[1], uneven[rank])


def read_by_the_end(common: int, mine: int) -> int:
    """How many items a rank with ``mine`` has read when the ranks agree that the
    epoch ends after ``common``: windows of 1, 2, 4, ... up to ``WINDOW`` items, each
    agreed on while the one before is handed on, the first that some rank cannot
    fill being the last read."""
    done, size = 0, 1
    while common - done >= size:  # every rank fills it
        done, size = done + size, min(2 * size, WINDOW)
    return done + min(size, mine - done)


def check_an_eval_pass_while_a_training_pull_waits(rank: int, batches: int = 20) -> None:
    """An async training source whose next batch arrives at once on rank 0 and only
    after an evaluation pass on rank 1 (forced: rank 0 waits until the batch is out,
    rank 1's source until the pass is over).  Each pipeline agrees on its batches in a
    group of its own: with one group, rank 0's training agreement met rank 1's first
    evaluation one, the passes went apart, and gloo aborted the job."""
    plain = build_dlrm_training(CONFIG, "sgd", seed=3)
    reference = SparseDistPipeline(plain.model, plain.optimizer, plain.device)
    assert len(asyncio.run(_collect_in(reference, iter(data(rank, batches))))) == batches
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)

    async def scenario() -> tuple[int, int]:
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device)
        evaluator = pipe.eval_pipeline()
        evaluated, out = asyncio.Event(), {i: asyncio.Event() for i in range(batches)}
        call, reads = a_call_that_starts_an_agreement(after=3)
        gated = reads[0]
        assert reads[-1] < batches

        async def training() -> Any:
            for i, batch in enumerate(data(rank, batches)):
                if rank == 1 and i == gated:
                    await evaluated.wait()
                out[i].set()  # the wrapper starts its agreement as soon as this is out
                yield batch

        source = training()
        async with pipe:
            # The ring's three batches and one read ahead take four calls of the
            # wrapper; each progress after the first one more (the last a pull under way).
            for _ in range(call - 3):  # the last starts the pull of the gated batch
                await pipe.progress(source)
            if rank == 0:  # its agreement is started: before the evaluation's
                await asyncio.wait_for(out[reads[-1]].wait(), 60)
            outputs = await collect(evaluator, iter(data(rank, 3, seed=8)))
            evaluated.set()
            steps = call - 3 + len(await collect(pipe, source))
            await evaluator.aclose()
        return len(outputs), steps

    assert asyncio.run(scenario()) == (3, batches)
    assert parameter_digest(setup.model) == parameter_digest(plain.model)


class _Settled:
    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _OneRank:
    """A group of one whose all-reduce is done at once: the wrapper's reads alone."""

    def allreduce(self, tensors: Any, options: Any) -> _Settled:
        return _Settled()


def a_call_that_starts_an_agreement(after: int) -> tuple[int, list[int]]:
    """The first call to the end-together wrapper after its first ``after`` that starts
    the agreement on a window (every rank filling every window), and the items it reads."""
    read: list[int] = []

    def counted() -> Iterator[int]:
        for index in itertools.count():
            read.append(index)
            yield index

    wrapper = EndedTogether(counted(), _OneRank())
    for call in itertools.count(1):
        before, waiting = len(read), wrapper._next
        next(wrapper)
        if call > after and waiting is None and wrapper._next is not None:
            return call, read[before:]
    raise AssertionError("unreachable")


def check_evaluation_ending_together(rank: int) -> None:
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    setup.model.eval()
    pipe = SparseDistEvalPipeline(setup.model, None, setup.device)
    outputs = asyncio.run(_collect_in(pipe, iter(data(rank, UNEVEN[rank]))))
    assert len(outputs) == UNEVEN[1]


async def _collect_in(pipe: Any, source: Any) -> list[Any]:
    async with pipe:
        return await collect(pipe, source)


#: Passes over the data in the family checks.
EPOCHS = 3


def family_worker(rank: int, port: int) -> None:
    join(rank, port)
    for schedule in ("base", "lite", "fused"):
        check_family_member(rank, schedule)
    for stash in (False, True):
        check_family_member(rank, "semi-sync", knobs={"start_batch": 2, "stash_gradients": stash})
    check_family_member(rank, "pt2", knobs={
        "compile_configs": TorchCompileConfig(backend="aot_eager", compile_on_iter=2)})
    check_prefetch(rank)
    leave_and_exit(0)


def check_prefetch(rank: int, batches: int = 3) -> None:
    """The prefetch schedule, async and blocking, trains like the plain loop over
    three passes, bit for bit (torchrec's PrefetchTrainPipelineSparseDist cannot run on
    a CPU: its prefetch does nothing there and its forwards then fail; the comparison
    with it is the cuda-marked test in test_sparse_family.py), and on two ranks its
    step runs on torchrec's prefetch forwards."""
    epochs = [data(rank, batches)] * EPOCHS
    plain = build_dlrm_training(CONFIG, "adagrad", seed=3)
    expected = (run_dlrm("none", plain, epochs).losses, parameter_digest(plain.model))
    setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
    run = run_dlrm("aiopipe-prefetch", setup, epochs)
    assert (run.losses, parameter_digest(setup.model)) == expected
    setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
    blocking = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  schedule="prefetch").blocking()  # fmt: skip
    try:
        losses = [float(loss) for epoch in epochs
                  for loss, _, _ in torchrec_results(blocking, epoch)]  # fmt: skip
        forwards = {type(module.forward) for module in setup.model.modules()
                    if isinstance(module, ShardedModule)}  # fmt: skip
        two_ranks = torch.distributed.get_world_size() > 1  # one: no input to distribute
        assert runs_rewritten(setup.model) is two_ranks
        if two_ranks:
            assert forwards == {PrefetchPipelinedForward}
    finally:
        blocking.shutdown()
    assert (losses, parameter_digest(setup.model)) == expected


def check_family_member(rank: int, schedule: str, batches: int = 3,
                        knobs: dict[str, Any] | None = None) -> None:  # fmt: skip
    """aiopipe's ``schedule``, in its async and its blocking form, trains like torchrec's
    class for it over three passes over the data: this rank's per-step losses and
    parameters, bit for bit (Adagrad: its state makes any step out of place show).
    The blocking form is driven as torchrec's class is (progress until StopIteration,
    a new iterator per pass); so is a pipeline with every task inline
    (``executor="sequential"``, which docs/sparse-dist.md suggests timing where CPU
    ranks share their cores)."""
    epochs = [data(rank, batches)] * EPOCHS
    outcomes = {}
    for mode in (f"torchrec-{schedule}", f"aiopipe-{schedule}"):
        setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
        run = run_dlrm(mode, setup, epochs, knobs=knobs)  # type: ignore[arg-type]
        outcomes[mode] = (run.losses, parameter_digest(setup.model))
    # lite and fused distribute the input on torchrec's rewrite where there is input to
    # distribute (two ranks); base runs the model's own forward everywhere; semi-sync's
    # step is the rewrite's
    ranks = torch.distributed.get_world_size()
    rewritten = schedule == "semi-sync" or (schedule in ("lite", "fused") and ranks > 1)
    for form, executor in (("blocking", None), ("sequential", "sequential")):
        setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
        blocking = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                      schedule=train_schedule(schedule, knobs),
                                      executor=executor).blocking()  # fmt: skip
        try:
            losses = [float(loss) for epoch in epochs
                      for loss, _, _ in torchrec_results(blocking, epoch)]  # fmt: skip
            assert runs_rewritten(setup.model) is rewritten
            # pt2 compiled the model at its step (torch's Module.compile keeps it here)
            assert (setup.model._compiled_call_impl is not None) is (schedule == "pt2")
            inline = isinstance(blocking.pipeline.executor, SequentialExecutor)
            assert inline is (executor == "sequential")
        finally:
            blocking.shutdown()
        outcomes[form] = (losses, parameter_digest(setup.model))
    expected = outcomes[f"torchrec-{schedule}"]
    assert len(expected[0]) == batches * EPOCHS
    for mode, outcome in outcomes.items():
        assert outcome == expected, (schedule, mode)


def accumulation_worker(rank: int, port: int) -> None:
    join(rank, port)
    for schedule in ("sparse-dist", "lite", "base", "fused", "semi-sync", "prefetch"):
        check_accumulation(rank, schedule)
    leave_and_exit(0)


def check_accumulation(rank: int, schedule: str, k: int = 3) -> None:
    """``grad_accumulation=k`` trains as the plain accumulation loop does: groups of k
    batches, a partial group at the end of each pass (7 batches), async and blocking."""
    epochs = [data(rank, 7)] * 2
    plain = build_dlrm_training(CONFIG, "adagrad", seed=3)
    expected = run_dlrm("none", plain, epochs, grad_accumulation=k)
    expected_digest = parameter_digest(plain.model)
    setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
    run = run_dlrm(f"aiopipe-{schedule}", setup, epochs, grad_accumulation=k)  # type: ignore[arg-type]
    assert (run.losses, parameter_digest(setup.model)) == (expected.losses, expected_digest)
    setup = build_dlrm_training(CONFIG, "adagrad", seed=3)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, schedule=schedule,
                              grad_accumulation=k).blocking()  # fmt: skip
    losses = [float(loss) for epoch in epochs for loss, _, _ in pipe.results(epoch)]
    pipe.shutdown()
    assert (losses, parameter_digest(setup.model)) == (expected.losses, expected_digest)
    assert len(losses) == 14
