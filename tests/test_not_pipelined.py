"""A sharded module whose input distribution torchrec's rewrite cannot pipeline is
named at the first progress (a warning; an error with ``strict=True``), instead of
the pipeline quietly running that module's input distribution inside forward."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
from one_rank import one_rank_group  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from hstu_tasks import DLRMConfig, InputDistNotPipelinedError  # noqa: E402
from hstu_tasks import InputDistNotPipelinedWarning, SparseDistPipeline  # noqa: E402
from hstu_tasks import SyntheticDLRMData, build_dlrm_training  # noqa: E402
from hstu_tasks.sparse import carries_torchrec_rewrite  # noqa: E402

CONFIG = DLRMConfig(num_embeddings=200, batch_size=16)


class RemappedIds(torch.nn.Module):
    """Computes the tables' input inside forward: torchrec cannot distribute it early."""

    def __init__(self, arch: torch.nn.Module) -> None:
        super().__init__()
        self.arch = arch

    def forward(self, features: KeyedJaggedTensor) -> Any:
        remapped = KeyedJaggedTensor(keys=features.keys(), values=features.values() // 2,
                                     lengths=features.lengths())  # fmt: skip
        return self.arch(remapped)


class CopiedBatch(torch.nn.Module):
    """Hands the sharded model a batch built inside forward: the trace never reaches
    the tables with a field of the batch."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch: Batch) -> Any:
        return self.inner(Batch(dense_features=batch.dense_features,
                                sparse_features=batch.sparse_features, labels=batch.labels))  # fmt: skip


class CalledTwice(torch.nn.Module):
    """Calls the tables twice per forward: torchrec's rewrite would pipeline the module
    once per call, and the second call would find its input distribution consumed."""

    def __init__(self, arch: torch.nn.Module) -> None:
        super().__init__()
        self.arch = arch

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.arch(features) * 0.5 + self.arch(features) * 0.5


def called_twice_model() -> tuple[torch.nn.Module, Any]:
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    dlrm = next(m for m in setup.model.modules() if type(m).__name__ == "DLRM")
    dlrm.sparse_arch = CalledTwice(dlrm.sparse_arch)
    return setup.model, setup.optimizer


def remapped_model() -> tuple[torch.nn.Module, Any]:
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    dlrm = next(m for m in setup.model.modules() if type(m).__name__ == "DLRM")
    dlrm.sparse_arch = RemappedIds(dlrm.sparse_arch)
    return setup.model, setup.optimizer


def copied_batch_model() -> tuple[torch.nn.Module, Any]:
    setup = build_dlrm_training(CONFIG, "sgd", seed=3)
    return CopiedBatch(setup.model), setup.optimizer


def train(pipe: SparseDistPipeline, batches: int = 4) -> list[Any]:
    async def run() -> list[Any]:
        async with pipe:
            return [out async for out in pipe.results(iter(SyntheticDLRMData(CONFIG, batches)))]

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (remapped_model, "its input is computed inside forward"),
        (copied_batch_model, "does not call it with the batch's fields"),
        (called_twice_model, "forward calls it 2 times"),
    ],
    ids=["input computed in forward", "not reached by the trace", "called twice"],
)
def test_a_module_left_unpipelined_is_named_at_the_first_progress(build: Any, reason: str) -> None:
    with one_rank_group():
        model, optimizer = build()
        pipe = SparseDistPipeline(model, optimizer, "cpu", pipelined_input_dist=True)
        with pytest.warns(InputDistNotPipelinedWarning) as caught:
            outputs = train(pipe)
        assert len(outputs) == 4  # the steps still run, the input dist inside forward
        message = str(caught[0].message)
        assert "embedding_bag_collection" in message and reason in message
        assert "0 of the model's 1 sharded module(s)" in message


def test_strict_refuses_it_and_leaves_the_model_as_it_was() -> None:
    with one_rank_group():
        model, optimizer = remapped_model()
        strict = SparseDistPipeline(model, optimizer, "cpu", pipelined_input_dist=True,
                                    strict=True)  # fmt: skip
        with pytest.raises(InputDistNotPipelinedError, match="strict=True refuses"):
            train(strict)
        strict.shutdown()
        assert not carries_torchrec_rewrite(model)
        with pytest.warns(InputDistNotPipelinedWarning):  # the model is usable as it is
            assert len(train(SparseDistPipeline(model, optimizer, "cpu",
                                                pipelined_input_dist=True))) == 4  # fmt: skip


def test_a_module_called_twice_trains_on_its_own_forward_like_the_plain_loop() -> None:
    """torchrec's rewrite of it would fail at the second call of the first step; given
    its own forward back, every step is the plain loop's, and shutdown() leaves the
    model with its own forwards (torchrec's detach would leave one pipelined)."""
    with one_rank_group():
        model, optimizer = called_twice_model()
        batches = list(SyntheticDLRMData(CONFIG, 4))
        expected = []
        for batch in batches:
            optimizer.zero_grad()
            loss, _ = model(batch)
            loss.backward()
            optimizer.step()
            expected.append(float(loss.detach()))
        model, optimizer = called_twice_model()
        pipe = SparseDistPipeline(model, optimizer, "cpu", pipelined_input_dist=True)
        with pytest.warns(InputDistNotPipelinedWarning, match="forward calls it 2 times"):
            losses = [float(loss.detach()) for loss, _, _ in train(pipe)]
        assert losses == expected
        assert not carries_torchrec_rewrite(model)


def test_a_model_pipelined_in_full_is_not_warned_about() -> None:
    with one_rank_group():
        setup = build_dlrm_training(CONFIG, "sgd", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                                  pipelined_input_dist=True, strict=True)  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error", InputDistNotPipelinedWarning)
            assert len(train(pipe)) == 4


def unsharded_model() -> tuple[torch.nn.Module, Any]:
    """torchrec's DLRM as it is before DistributedModelParallel shards its tables."""
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(3)
    tables = [EmbeddingBagConfig(name=f"table_{i}", embedding_dim=CONFIG.embedding_dim,
                                 num_embeddings=CONFIG.num_embeddings, feature_names=[feature])
              for i, feature in enumerate(CONFIG.features)]  # fmt: skip
    model = DLRMTrain(DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables),
        dense_in_features=CONFIG.num_dense, dense_arch_layer_sizes=list(CONFIG.dense_arch),
        over_arch_layer_sizes=list(CONFIG.over_arch),
    ))  # fmt: skip
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_model_with_no_sharded_module_is_warned_of_and_refused_when_strict() -> None:
    """Nothing to distribute, and on several ranks nothing keeping the ranks' copies in
    step: named at the first progress, whatever the rank count or schedule."""
    with one_rank_group():
        model, optimizer = unsharded_model()
        with pytest.warns(InputDistNotPipelinedWarning, match="no module sharded by torchrec"):
            assert len(train(SparseDistPipeline(model, optimizer, "cpu"))) == 4
        strict = SparseDistPipeline(model, optimizer, "cpu", strict=True, schedule="base")
        with pytest.raises(InputDistNotPipelinedError, match="shard the model first"):
            train(strict)


def test_strict_checks_on_one_cpu_rank_too_where_nothing_is_rewritten() -> None:
    """One CPU rank keeps the model's own forwards by default, so nothing is rewritten;
    strict=True still traces the model once as the rewrite on more ranks would, and
    refuses what that would miss.  A model it passes trains on its own forwards like
    the plain loop; a schedule that never pipelines (base) checks nothing."""
    with one_rank_group():
        model, optimizer = remapped_model()
        strict = SparseDistPipeline(model, optimizer, "cpu", strict=True)
        with pytest.raises(InputDistNotPipelinedError, match="its input is computed inside"):
            train(strict)
        assert not carries_torchrec_rewrite(model)
        assert len(train(SparseDistPipeline(model, optimizer, "cpu", strict=True,
                                            schedule="base"))) == 4  # fmt: skip
        batches = list(SyntheticDLRMData(CONFIG, 4))
        plain = build_dlrm_training(CONFIG, "sgd", seed=3)
        expected = []
        for batch in batches:
            plain.optimizer.zero_grad()
            loss, _ = plain.model(batch)
            loss.backward()
            plain.optimizer.step()
            expected.append(float(loss.detach()))
        setup = build_dlrm_training(CONFIG, "sgd", seed=3)
        pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device, strict=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", InputDistNotPipelinedWarning)
            losses = [float(loss.detach()) for loss, _, _ in train(pipe)]
        assert losses == expected
        assert not carries_torchrec_rewrite(setup.model)
