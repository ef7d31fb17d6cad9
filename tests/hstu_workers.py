"""Worker functions for the two-rank HSTU tests (spawned processes import this)."""

from __future__ import annotations

import asyncio
import faulthandler
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import collect

import hstu_tasks.tasks as tasks_module
from aiopipe import AsyncExecutor, ConfigurationError, PipelineStateError
from hstu_tasks import (
    HSTU_DEFAULT_THREAD_MAP,
    DataConfig,
    HSTUPipeline,
    HSTUPipelineFactory,
    HSTURankingModel,
    KarmarkarKarpShuffler,
    ModelConfig,
    OptimizerConfig,
    SyntheticHSTUData,
    build_training,
    join_local_group,
    leave_and_exit,
    quiet_torchrec,
)
from hstu_tasks.megatron import (
    MegatronDataParallelWrapper,
    finalize_grads,
    grad_buffer_chunks,
    zero_grad_buffers,
)
from hstu_tasks.parallel import TrainingSetup, global_loss, global_tokens, shard_model
from hstu_tasks.runners import PIPELINES, parameter_checksum, parameter_digest, run_pipeline

DATA = DataConfig(batch_size=8, max_history=24)
STEPS = 6


def join(rank: int, port: int) -> None:
    faulthandler.enable()  # a native abort in a worker shows every thread's stack
    quiet_torchrec()
    join_local_group(rank, 2, port)


def finish() -> None:
    leave_and_exit(0)  # every check of the worker has passed


def setup(kind: str = "sgd") -> Any:
    return build_training(ModelConfig(), DATA, OptimizerConfig(kind=kind), seed=3,
                          data_parallel="torch")  # fmt: skip


def equality_worker(rank: int, port: int, kind: str) -> None:
    join(rank, port)
    outcomes = {}
    runs = [(mode, None) for mode in PIPELINES] + [("aiopipe", "per_task")]
    for mode, thread_map in runs:
        # per_task: every task on its own lane, so only the ticket order keeps the
        # embedding all-to-alls and DDP's all-reduces in one order on both ranks
        training = setup(kind)
        data = SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank)
        result = run_pipeline(mode, training, data, thread_map=thread_map)
        outcomes[f"{mode}/{thread_map}"] = (result.global_losses(), parameter_checksum(training.model))
    reference = outcomes["none/None"]
    assert len(reference[0]) == STEPS
    for mode, outcome in outcomes.items():
        assert outcome == reference, (mode, outcome, reference)
    finish()


def end_together_worker(rank: int, port: int) -> None:
    """6 batches on rank 0, 4 on rank 1: both ranks train 4 steps and end the epoch
    together, exactly as with 4 batches on each (both HSTU variants)."""
    join(rank, port)
    even = setup()
    run_pipeline("aiopipe", even, SyntheticHSTUData(DATA, 4, seed=5, rank=rank))
    expected = parameter_checksum(even.model)
    for mode in ("aiopipe", "aiopipe-prefetch"):
        training = setup()
        result = run_pipeline(mode, training, SyntheticHSTUData(DATA, (6, 4)[rank], seed=5,
                                                                rank=rank))  # fmt: skip
        assert result.steps == 4, mode
        assert parameter_checksum(training.model) == expected, mode
    finish()


def contract_worker(rank: int, port: int) -> None:
    join(rank, port)
    training = setup()
    data = SyntheticHSTUData(DATA, 4, seed=1, rank=rank)
    assert HSTUPipelineFactory.list() == ["hstu_prefetch_sparse_dist", "hstu_sparse_dist"]
    with pytest.raises(KeyError, match="unknown HSTU pipeline"):
        HSTUPipelineFactory.create("nope")
    with pytest.raises(ConfigurationError) as unknown:  # also a ValueError, unquoted
        HSTUPipelineFactory.create("hstu_sparse")
    assert str(unknown.value).startswith(
        "unknown HSTU pipeline 'hstu_sparse' (did you mean 'hstu_sparse_dist'?)"
    )
    pipe = HSTUPipelineFactory.create(
        "hstu_prefetch_sparse_dist", model=training.model, optimizer=training.optimizer,
        device=training.device,
    )  # fmt: skip

    async def scenario() -> None:
        # end of data: M batches -> M results, then StopAsyncIteration, again and again
        source = iter(data)
        results = await collect(pipe, source)
        assert len(results) == 4 and all(len(r) == 3 for r in results)
        with pytest.raises(StopAsyncIteration):
            await pipe.progress(source)
        assert len(pipe._state.pipelined_modules) == 1  # torchrec rewrote the embeddings
        # train -> eval switch mid-epoch: drain, then a new iterator, no weight change
        train_source = iter(SyntheticHSTUData(DATA, 6, seed=2, rank=rank))
        await pipe.progress(train_source)
        with pytest.raises(PipelineStateError, match="in flight"):
            await pipe.progress(iter(data))
        assert len(await pipe.drain()) == 3  # two batches in the ring, one read ahead
        training.model.eval()
        before = parameter_checksum(training.model)
        evaluated = await collect(pipe, iter(data))
        assert len(evaluated) == 4 and parameter_checksum(training.model) == before
        training.model.train()
        # detach gives the model back with its own forward; attach + progress rebuild
        model = pipe.detach()
        losses, _ = model(next(iter(data)).to(training.device))
        assert losses.shape[1] == DATA.num_tasks
        with pytest.raises(PipelineStateError, match="detached"):
            await pipe.progress(iter(data))
        pipe.attach()
        assert len(await collect(pipe, iter(data))) == 4
        with pytest.raises(PipelineStateError, match="detach"):  # not under a running pipeline
            pipe.attach(training.model)

    asyncio.run(scenario())
    # the blocking form raises StopIteration at the end, like torchrec
    blocking = pipe.blocking()
    source = iter(data)
    assert len(list(blocking.results(source))) == 4
    with pytest.raises(StopIteration):
        blocking.progress(source)
    blocking.shutdown()
    # an executor instance serves one engine: a rebuild is refused before taking a batch
    pipe = HSTUPipeline(training.model, training.optimizer, training.device,
                        executor=AsyncExecutor(HSTU_DEFAULT_THREAD_MAP))  # fmt: skip
    assert len(asyncio.run(collect(pipe, iter(data)))) == 4
    pipe.detach()
    pipe.attach()
    source = iter(data)
    async def one_step() -> None:
        await pipe.progress(source)

    with pytest.raises(PipelineStateError, match="executor serves one pipeline"):
        asyncio.run(one_step())
    assert torch.equal(next(source).labels, data.batch(0).labels)  # nothing was taken
    pipe.shutdown()
    finish()


def shuffle_worker(rank: int, port: int) -> None:
    join(rank, port)
    shuffler = KarmarkarKarpShuffler()
    config = DataConfig(batch_size=8, max_history=40, length_distribution="zipf")
    uneven = DataConfig(batch_size=6 if rank == 0 else 2, max_history=40)  # 8 to share

    def signature(b: Any) -> list[tuple[int, ...]]:
        items = b.features["item"].values().split(b.features["item"].lengths().tolist())
        return sorted(tuple(i.tolist()) for i in items)

    batches = list(SyntheticHSTUData(config, 3, seed=9, rank=rank))
    for batch in [*batches, next(iter(SyntheticHSTUData(uneven, 1, seed=9, rank=rank)))]:
        mine = shuffler.finish_shuffle(shuffler.start_shuffle_async(batch))
        assert mine.batch_size == (8 if batch.batch_size == 8 else 4)  # the uneven pair: 4 each
        # every sample of every rank lands on exactly one rank: compare multisets
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, (signature(batch), signature(mine)))
        before = sorted(s for original, _ in gathered for s in original)
        after = sorted(s for _, shuffled in gathered for s in shuffled)
        assert before == after
    odd = DataConfig(batch_size=3 if rank == 0 else 2, max_history=40)  # 5 samples, 2 ranks
    with pytest.raises(ValueError, match="cannot share equally"):  # on both ranks, no hang
        shuffler.start_shuffle_async(next(iter(SyntheticHSTUData(odd, 1, rank=rank))))
    # and the whole pipeline trains with it, twice: a pipeline's shutdown closes the
    # shuffler's thread, and the next pipeline's first shuffle starts a new one
    for _ in range(2):
        training = setup()
        pipe = HSTUPipelineFactory.create("hstu_sparse_dist", model=training.model,
                                          optimizer=training.optimizer, device=training.device,
                                          batch_shuffler=shuffler)  # fmt: skip
        data = SyntheticHSTUData(config, 5, seed=4, rank=rank)
        results = asyncio.run(collect(pipe, iter(data)))
        assert len(results) == 5
        tokens = [float(t) for _, t, _ in results]
        totals = torch.tensor([float(b.loss_tokens()) for b in data])
        dist.all_reduce(totals)
        assert tokens == totals.tolist()  # the global token count is preserved by shuffling
        pipe.shutdown()
    finish()


# -- Megatron DDP on gloo ---------------------------------------------------------------


def megatron_optimizer_stand_in(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """Stands in for Megatron's optimizer, which creates CUDA tensors when it is built:
    like its FP32 optimizer, point each ``grad`` at the reduced ``main_grad``, then step
    the wrapped torch optimizer."""

    class MainGradOptimizer(base):  # type: ignore[valid-type, misc]
        def step(self, closure: Any = None) -> Any:
            for group in self.param_groups:
                for param in group["params"]:
                    param.grad = param.main_grad
            return super().step(closure)

    return MainGradOptimizer


def megatron_setup(kind: str, overlap: bool) -> Any:
    config = OptimizerConfig(kind=kind)
    model = shard_model(
        ModelConfig(), DATA, config, seed=3, device=torch.device("cpu"),
        # small buckets: several all-reduces per step, started while backward runs
        data_parallel_wrapper=MegatronDataParallelWrapper(
            overlap_grad_reduce=overlap, bucket_size=2048),
    )  # fmt: skip
    chunks = grad_buffer_chunks(model)
    params = [p for chunk in chunks for p in chunk.parameters()]
    base = torch.optim.SGD if kind == "sgd" else torch.optim.Adam
    optimizer = megatron_optimizer_stand_in(base)(params, lr=config.dense_lr)
    return TrainingSetup(model, optimizer, torch.device("cpu"), "megatron")


def megatron_worker(rank: int, port: int, kind: str, overlap: bool) -> None:
    join(rank, port)
    # Megatron allocates its gradient buffers on torch.cuda.current_device(); this
    # process has no GPU, so point that at the CPU.  Everything else -- Megatron DDP's
    # hooks and buckets, finalize_model_grads, the gloo all-reduces -- runs as is.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]

    reference = setup(kind)
    expected = run_pipeline("none", reference, SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank))
    expected_digest = parameter_digest(reference.model)

    # The wrapper replaced the dense part only: tables stay sharded by torchrec.
    training = megatron_setup(kind, overlap)
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP  # imported now

    chunks = grad_buffer_chunks(training.model)
    assert [type(c) for c in chunks] == [MegatronDDP], chunks
    assert isinstance(training.model.module.dense, MegatronDDP)
    # with overlap, several buckets whose all-reduces start while backward runs
    # (without it Megatron keeps one bucket, reduced in finalize_model_grads)
    buckets = sum(len(group.buckets) for group in chunks[0].bucket_groups)
    assert buckets > 1 if overlap else buckets == 1, buckets

    # finalize_model_grads is where the reduction completes: before it, the ranks'
    # gradient buffers hold their own (different) gradients; after it, the same mean.
    # (A first step reduces nothing during backward, even with overlap: Megatron
    # records the order in which gradients become ready then.)
    batch = next(iter(SyntheticHSTUData(DATA, 1, seed=9, rank=rank)))
    zero_grad_buffers(chunks)
    losses, _ = training.model(batch)
    global_loss(losses.sum(), global_tokens(batch)).backward()
    local = torch.cat([p.main_grad.flatten() for p in chunks[0].parameters()])
    finalize_grads(chunks)
    reduced = torch.cat([p.main_grad.flatten() for p in chunks[0].parameters()])
    gathered = [torch.empty_like(reduced) for _ in range(2)]
    dist.all_gather(gathered, reduced)
    assert torch.equal(gathered[0], gathered[1])
    gathered_local = [torch.empty_like(local) for _ in range(2)]
    dist.all_gather(gathered_local, local)
    assert not torch.equal(gathered_local[0], gathered_local[1])
    assert torch.allclose(reduced, (gathered_local[0] + gathered_local[1]) / 2)

    # The same training, bit for bit, as torch DDP's plain loop: from the plain loop
    # and from the pipelines (per_task: finalize_model_grads on its own lane, where
    # only the ticket order keeps its collectives in step with the other rank's).
    for mode, thread_map in [("none", None), ("aiopipe", None), ("aiopipe", "per_task"),
                             ("aiopipe-prefetch", None)]:  # fmt: skip
        training = megatron_setup(kind, overlap)
        data = SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank)
        result = run_pipeline(mode, training, data, thread_map=thread_map)
        assert result.global_losses() == expected.global_losses(), (mode, thread_map)
        assert parameter_digest(training.model) == expected_digest, (mode, thread_map)
    with pytest.raises(ValueError, match="finalize_model_grads"):
        run_pipeline("torchrec", training, [])
    if not overlap:  # the check above can fail: with a no-op finalize task the ranks
        # step on their own gradients.  (With overlap Megatron itself refuses the next
        # step, so a failed rank could leave the other in a collective.)
        real, tasks_module.finalize_grads = tasks_module.finalize_grads, lambda chunks: None
        try:
            training = megatron_setup(kind, overlap)
            run_pipeline("aiopipe", training, SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank))
        finally:
            tasks_module.finalize_grads = real
        assert parameter_digest(training.model) != expected_digest
    finish()


def megatron_gpu_worker(rank: int, port: int, world: int) -> None:
    """One GPU per rank, NCCL: Megatron DDP and Megatron's optimizer unpatched.  The
    tables are replicated (shard_embeddings=False), so fbgemm's GPU kernels are not
    needed."""
    faulthandler.enable()
    quiet_torchrec()
    join_local_group(rank, world, port)  # also makes cuda:rank this process's device
    outcomes = {}
    for data_parallel, thread_map in [("torch", None), ("megatron", None),
                                      ("megatron", "per_task")]:  # fmt: skip
        training = build_training(ModelConfig(), DATA, OptimizerConfig(), seed=3,
                                  data_parallel=data_parallel, shard_embeddings=False)  # fmt: skip
        assert training.data_parallel == data_parallel
        data = SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank)
        losses = run_pipeline("aiopipe", training, data, thread_map=thread_map).global_losses()
        model = getattr(training.model, "module", training.model)  # torch DDP's prefix
        outcomes[data_parallel, thread_map] = (losses, model.state_dict())
    # Megatron's optimizer may be a fused kernel (Transformer Engine, Apex): close, not
    # necessarily bit-identical to torch.optim.
    reference = outcomes["torch", None]
    for key, outcome in outcomes.items():
        torch.testing.assert_close(outcome, reference, rtol=1e-4, atol=1e-6, msg=str(key))
    finish()


def unsharded_worker(rank: int, port: int) -> None:
    """Tables not sharded (every parameter replicated): torch DDP and Megatron DDP
    (buffers pointed at the CPU, as in megatron_worker) train like the plain loop."""
    join(rank, port)
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]

    def replicated() -> Any:
        return build_training(ModelConfig(), DATA, OptimizerConfig(), seed=3,
                              data_parallel="torch", shard_embeddings=False)  # fmt: skip

    def megatron_replicated() -> Any:
        torch.manual_seed(3)
        model = HSTURankingModel(ModelConfig(), DATA, embedding_device="cpu")
        MegatronDataParallelWrapper(bucket_size=4096).wrap_dense_children(model)
        chunks = grad_buffer_chunks(model)
        assert len(chunks) == 2  # the embedding collection and the dense part
        params = [p for chunk in chunks for p in chunk.parameters()]
        optimizer = megatron_optimizer_stand_in(torch.optim.SGD)(params, lr=0.05)
        return TrainingSetup(model, optimizer, torch.device("cpu"), "megatron", sharded=False)

    training = replicated()
    assert not training.sharded
    assert isinstance(training.model, torch.nn.parallel.DistributedDataParallel)
    reference = run_pipeline("none", training, SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank))
    expected = (reference.global_losses(), parameter_digest(training.model.module))
    runs = [(replicated, "aiopipe", None), (replicated, "aiopipe", "per_task"),
            (replicated, "aiopipe-prefetch", None), (megatron_replicated, "none", None),
            (megatron_replicated, "aiopipe", "per_task")]  # fmt: skip
    for build, mode, thread_map in runs:
        training = build()
        data = SyntheticHSTUData(DATA, STEPS, seed=5, rank=rank)
        result = run_pipeline(mode, training, data, thread_map=thread_map)
        model = getattr(training.model, "module", training.model)  # torch DDP's prefix
        assert (result.global_losses(), parameter_digest(model)) == expected, (build, mode)
    with pytest.raises(ValueError, match="needs sharded embeddings"):
        run_pipeline("torchrec", replicated(), [])
    finish()
