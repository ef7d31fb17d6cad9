"""hstu_tasks: the HSTU step on aiopipe, torchrec's pipeline and a plain loop (2 ranks, gloo)."""

from __future__ import annotations

import asyncio
import math
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.sparse.jagged_tensor import JaggedTensor

import hstu_workers
from conftest import CompletesOnWait, collect
from one_rank import TINY_DATA, one_rank_group, tiny_training
from hstu_tasks import DataConfig, HSTUPipeline, OptimizerConfig, SyntheticHSTUData, TrainingSetup
from hstu_tasks import balanced_partition
from hstu_tasks import training_state
from aiopipe import Schedule
from aiopipe.edges import topological_sort
from hstu_tasks.parallel import resolve_data_parallel
from hstu_tasks.shuffler import IdentityShuffler
from hstu_tasks.tasks import PipelineState, build_tasks
from hstu_tasks.model import attention_mask, interleave
from hstu_tasks.runners import RunResult

pytestmark = pytest.mark.distributed


def spawn(worker: object, *args: object, nprocs: int = 2) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(port, *args), nprocs=nprocs, join=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_every_pipeline_matches_the_plain_loop_bit_for_bit(optimizer: str) -> None:
    """aiopipe (both variants), torchrec's TrainPipelineSparseDist and the plain loop:
    identical per-step global losses and final parameters (same arithmetic in the
    same order per batch, so exact equality is expected and required)."""
    spawn(hstu_workers.equality_worker, optimizer)


def test_ranks_with_different_numbers_of_batches_end_the_epoch_together() -> None:
    spawn(hstu_workers.end_together_worker)


def test_progress_contract_iterator_switch_and_detach_attach() -> None:
    spawn(hstu_workers.contract_worker)


def test_shuffler_moves_every_sample_exactly_once() -> None:
    spawn(hstu_workers.shuffle_worker)


# -- single-process pieces -------------------------------------------------------------


def test_results_yields_what_progress_does_and_checks_the_last_losses() -> None:
    with one_rank_group():
        data = SyntheticHSTUData(TINY_DATA, 4, seed=1, rank=0)
        training = tiny_training()
        pipe = HSTUPipeline(training.model, training.optimizer, training.device)
        expected = asyncio.run(collect(pipe, iter(data)))
        pipe.shutdown()

        training = tiny_training()
        pipe = HSTUPipeline(training.model, training.optimizer, training.device)
        # a loss copy still on its way when the data ends: results() waits for it
        # and raises, as progress() does at the end
        arriving = CompletesOnWait()
        pipe._state.watch.defer(99, torch.tensor(math.nan), arriving)
        seen: list[tuple[float, float]] = []

        async def train() -> None:
            async with pipe:
                async for loss_sum, tokens, _ in pipe.results(data):  # an iterable: a new pass
                    seen.append((float(loss_sum), float(tokens)))

        with pytest.raises(FloatingPointError, match="batch 99"):
            asyncio.run(train())
        assert arriving.done
        assert seen == [(float(loss), float(tokens)) for loss, tokens, _ in expected]


class _Rewound:
    """The one iterator object a ``DataLoader`` with ``persistent_workers=True`` hands
    out: every ``iter(loader)`` rewinds it."""

    def __init__(self, items: object) -> None:
        self._items, self._next = list(items), 0  # type: ignore[call-overload]

    def __iter__(self) -> _Rewound:
        return self

    def __next__(self) -> object:
        if self._next == len(self._items):
            raise StopIteration
        self._next += 1
        return self._items[self._next - 1]

    def rewind(self) -> None:
        self._next = 0


def test_an_ended_source_passed_again_is_read_afresh() -> None:
    with one_rank_group():
        data = SyntheticHSTUData(TINY_DATA, 3, seed=1, rank=0)
        training = tiny_training()
        pipe = HSTUPipeline(training.model, training.optimizer, training.device)
        source = _Rewound(data)

        async def two_epochs() -> tuple[list, list]:
            async with pipe:
                first = await collect(pipe, source)
                assert pipe.engine is not None
                assert pipe.engine.statistics().returned == 3  # it still describes the source
                with pytest.raises(StopAsyncIteration):  # not rewound: it ends again
                    await pipe.progress(source)
                source.rewind()  # the next epoch of a persistent-worker loader
                return first, await collect(pipe, source)

        first, second = asyncio.run(two_epochs())
    assert len(first) == len(second) == 3
    assert [float(t) for _, t, _ in second] == [float(t) for _, t, _ in first]  # the same batches


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(0, 10_000), min_size=0, max_size=40), parts=st.integers(1, 4))
def test_balanced_partition_is_an_equal_count_partition(weights: list[int], parts: int) -> None:
    weights = weights[: len(weights) - len(weights) % parts]
    split = balanced_partition(weights, parts)
    assert len(split) == parts
    assert sorted(i for part in split for i in part) == list(range(len(weights)))
    assert {len(part) for part in split} <= {len(weights) // parts}
    assert split == balanced_partition(weights, parts)  # deterministic on every rank


def test_balanced_partition_beats_round_robin_on_skewed_weights() -> None:
    weights = [(10 + (i * 37) % 50) ** 2 for i in range(32)]  # sequence lengths 10..59

    def spread(parts: list[list[int]]) -> int:
        sums = [sum(weights[i] for i in p) for p in parts]
        return max(sums) - min(sums)

    round_robin = [list(range(r, 32, 4)) for r in range(4)]
    assert spread(balanced_partition(weights, 4)) < spread(round_robin) / 4
    with pytest.raises(ValueError, match="evenly"):
        balanced_partition([1, 2, 3], 2)


@pytest.mark.parametrize("prefetch", [False, True])
def test_next_input_dist_is_waited_for_between_forward_and_backward(prefetch: bool) -> None:
    # torchrec's order: the next batch's splits all-to-all has this forward to arrive
    state = PipelineState(torch.nn.Linear(1, 1), None, torch.device("cpu"), IdentityShuffler(),
                          prefetch=prefetch)  # fmt: skip
    order = [task.name for task in topological_sort(Schedule.of(build_tasks(state)))]
    chain = ["start_input_dist", "forward", "wait_input_dist", "backward", "optimizer_step"]
    if prefetch:
        chain.insert(3, "prefetch_embeddings")
    assert sorted(chain, key=order.index) == chain, order


def test_pipeline_refuses_a_prefetch_depth_without_prefetch() -> None:
    with pytest.raises(ValueError, match="prefetch variant only"):
        HSTUPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"), prefetch_depth=2)
    pipe = HSTUPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"), prefetch=True,
                        prefetch_depth=2)  # fmt: skip
    assert pipe.engine is None  # built lazily, on the first progress
    pipe.shutdown()


def test_configs_refuse_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="min_history <= max_history"):
        DataConfig(min_history=10, max_history=5)
    with pytest.raises(ValueError, match="batch_size=0, num_items=0"):
        DataConfig(batch_size=0, num_items=0)
    with pytest.raises(ValueError, match="length_distribution"):
        DataConfig(length_distribution="normal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_batches"):
        SyntheticHSTUData(DataConfig(), -1)
    with pytest.raises(ValueError, match="'sgd' or 'adam'"):
        OptimizerConfig(kind="Adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown thread_map"):  # before any batch is taken
        HSTUPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"), thread_map="bogus")
    for executor in (None, "async"):  # "async" is the default executor, named
        with pytest.raises(ValueError, match=r"names task\(s\) \['foward'\].*mean 'forward'"):
            HSTUPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"),
                         thread_map={"foward": "x"}, executor=executor)  # fmt: skip


class _MegatronLikeChunk(torch.nn.Linear):
    """What ``grad_buffer_chunks`` recognises: Megatron DDP's two buffer methods."""

    def finish_grad_sync(self) -> None: ...

    def zero_grad_buffer(self) -> None: ...


def test_attaching_another_model_finds_its_megatron_chunks() -> None:
    pipe = HSTUPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"))
    assert pipe._state.grad_chunks == []
    chunk = _MegatronLikeChunk(1, 1)
    pipe.detach()
    pipe.attach(torch.nn.Sequential(chunk))
    assert pipe._state.grad_chunks == [chunk]  # zero_grad/finalize reach the new buffers
    pipe.shutdown()


def test_interleave_alternates_items_and_actions_then_candidates() -> None:
    # two users: history 2 + 1 candidate, history 1 + 2 candidates; values encode ids
    items = JaggedTensor(values=torch.tensor([[1.0], [2.0], [9.0], [3.0], [8.0], [7.0]]),
                         lengths=torch.tensor([3, 3]))  # fmt: skip
    actions = JaggedTensor(values=torch.tensor([[-1.0], [-2.0], [-3.0]]), lengths=torch.tensor([2, 1]))
    tokens, lengths, history = interleave(items, actions, torch.tensor([1, 2]))
    assert lengths.tolist() == [5, 4] and history.tolist() == [2, 1]
    assert tokens[0, :, 0].tolist() == [1.0, -1.0, 2.0, -2.0, 9.0]
    assert tokens[1, :, 0].tolist() == [3.0, -3.0, 8.0, 7.0, 0.0]  # padded


def test_attention_mask_is_causal_over_history_and_isolates_candidates() -> None:
    mask = attention_mask(torch.tensor([5]), torch.tensor([1]), 5)[0]  # i a c c c
    assert mask[1].tolist() == [True, True, False, False, False]  # history: causal
    assert mask[3].tolist() == [True, True, False, True, False]  # candidate: history + self
    assert not mask[:, 2:].triu(1)[2:].any()


def test_synthetic_data_is_deterministic_and_distinct_per_rank() -> None:
    config = DataConfig(batch_size=4)
    first = SyntheticHSTUData(config, 2, seed=1, rank=0).batch(1)
    again = SyntheticHSTUData(config, 2, seed=1, rank=0).batch(1)
    other = SyntheticHSTUData(config, 2, seed=1, rank=1).batch(1)
    assert torch.equal(first.features.values(), again.features.values())
    assert not torch.equal(first.labels, other.labels) or not torch.equal(
        first.features.values(), other.features.values()
    )
    assert int(first.loss_tokens()) == int(first.num_candidates.sum()) == first.labels.numel()
    zipf = SyntheticHSTUData(DataConfig(batch_size=256, length_distribution="zipf"), 1).batch(0)
    lengths = zipf.history_lengths()
    assert lengths.float().median() < (DataConfig.min_history + DataConfig.max_history) / 2


ON_GPU = pytest.mark.skipif(
    torch.cuda.is_available(), reason="gloo with buffers on the CPU; the GPU test runs it as is"
)


@ON_GPU
@pytest.mark.parametrize(("optimizer", "overlap"), [("sgd", True), ("adam", False)])
def test_megatron_ddp_trains_like_torch_ddp(optimizer: str, overlap: bool) -> None:
    """Megatron DDP for the dense part (real megatron-core hooks, buckets and
    finalize_model_grads on gloo; only its buffer device is pointed at the CPU):
    finalize_model_grads completes the reduction, every pipeline trains bit for bit
    like torch DDP's plain loop, and (without overlap) a no-op finalize task does not."""
    spawn(hstu_workers.megatron_worker, optimizer, overlap)


@ON_GPU
def test_unsharded_tables_train_like_the_plain_loop() -> None:
    """shard_embeddings=False (every parameter replicated, plain torch operators only):
    aiopipe with torch DDP or Megatron DDP matches the plain loop bit for bit."""
    spawn(hstu_workers.unsharded_worker)


@pytest.mark.cuda  # Megatron DDP unpatched needs a GPU
def test_megatron_ddp_on_gpu_trains_like_torch_ddp() -> None:
    world = min(2, torch.cuda.device_count())
    spawn(hstu_workers.megatron_gpu_worker, world, nprocs=world)


def test_data_parallel_choice() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_data_parallel("auto", cpu) == "torch"
    assert resolve_data_parallel("torch", gpu) == "torch"
    assert resolve_data_parallel("auto", gpu) == "megatron"  # megatron-core is installed
    assert resolve_data_parallel("megatron", gpu) == "megatron"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_data_parallel("megatron", cpu)
    with pytest.raises(ValueError, match="'auto', 'torch' or 'megatron'"):
        resolve_data_parallel("fsdp", cpu)  # type: ignore[arg-type]


def test_checkpoints_refuse_megatron_setups() -> None:
    setup = TrainingSetup(torch.nn.Linear(1, 1), None, torch.device("cpu"), "megatron")
    with pytest.raises(NotImplementedError, match="sharded torch-DDP setups"):
        training_state(setup)


def test_check_batch_names_the_samples_whose_item_lengths_are_wrong() -> None:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from hstu_tasks import HSTUBatch
    from hstu_tasks.data import check_batch

    batch = SyntheticHSTUData(TINY_DATA, 1, seed=0).batch(0)
    check_batch(batch)  # as made: one item per action, then the candidates
    size = batch.num_candidates.numel()
    lengths = batch.features.lengths().clone()
    lengths[1] += 1  # sample 1: one item too many (and the values to match)
    values = torch.cat([batch.features.values(), torch.zeros(1, dtype=torch.int64)])
    broken = HSTUBatch(KeyedJaggedTensor.from_lengths_sync(["item", "action"], values, lengths),
                       batch.num_candidates, batch.labels)  # fmt: skip
    assert broken.features.stride() == size
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\] have item lengths"):
        check_batch(broken)


def test_a_run_reads_device_losses_after_its_steps_not_in_each() -> None:
    """Reading a loss on the host in every step would make the host wait for the
    device every step; values that are not on the CPU stay as they are until read."""
    result = RunResult()
    result.record(torch.tensor(2.0), torch.tensor(4.0))
    on_device = torch.empty((), device="meta")  # float() of it raises: never read here
    result.record(on_device, on_device)
    result.record(torch.tensor(3.0), torch.tensor(6.0))  # kept in order behind it
    assert result.steps == 3 and result.loss_sums == [2.0] and result.tokens == [4.0]
    assert len(result.unread) == 2
