"""aiopipe.basic: the standard training step as a pipeline."""

from __future__ import annotations

import collections
import dataclasses
import difflib
import gc
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from conftest import collect

from aiopipe import AsyncExecutor, PipelineError, SchedulablePipeline, basic, move_to_device

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "migration"


def make(seed: int, optimizer: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if optimizer == "sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batches(count: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=generator), torch.randn(16, 1, generator=generator))
            for _ in range(count)]  # fmt: skip


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, batch[1])


def forward(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def plain_loop(
    data: list, optimizer: str, accumulate: int = 1, passes: list[list] | None = None
) -> tuple[list[float], list[torch.Tensor]]:
    """The plain loop over ``data`` (or each of ``passes`` in turn: a group of
    ``accumulate`` batches never spans two)."""
    model, opt = make(0, optimizer)
    losses = []
    for part in passes if passes is not None else [data]:
        for i, batch in enumerate(part):
            if i % accumulate == 0:
                opt.zero_grad()
            loss = loss_fn(forward(model, batch), batch)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate == 0 or i == len(part) - 1:
                opt.step()
            losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


PRESETS = {"T1": {}, "T2": {"prefetch": True, "memcpy_stream": True}}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_parameters_equal_the_plain_loop_bit_for_bit(
    optimizer: str, preset: str, executor: str
) -> None:
    data = batches(12)
    model, opt = make(0, optimizer)
    pipe = basic(
        model, opt, loss_fn=loss_fn, forward=forward, executor=executor, **PRESETS[preset]
    )
    async with pipe:
        losses = [float(loss) for loss in await collect(pipe, iter(data))]
    expected_losses, expected_params = plain_loop(data, optimizer)
    assert losses == expected_losses
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)


def lanes_of(pipe: SchedulablePipeline) -> dict[str, str]:
    lane_of = pipe.executor.lane_of  # type: ignore[attr-defined]
    return {t.name: lane_of(t.name) for t in pipe.schedule.tasks}


async def test_t2_moves_batches_one_ahead_on_their_own_stream() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, prefetch=True,
                                     memcpy_stream=True)  # fmt: skip
    h2d = pipe.schedule.task("h2d")
    assert (h2d.lookahead, h2d.stream) == (1, "memcpy")
    # A CPU has no copy engine for a lane of its own to overlap with: one lane.
    assert set(lanes_of(pipe).values()) == {"compute"}
    pipe.shutdown()


@pytest.mark.cuda
async def test_t2_on_a_gpu_copies_on_a_lane_of_their_own() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model.cuda(), opt, loss_fn=loss_fn, forward=forward,
                                     prefetch=True, memcpy_stream=True)  # fmt: skip
    lanes = lanes_of(pipe)
    assert lanes.pop("h2d") == "io" and set(lanes.values()) == {"compute"}
    pipe.shutdown()


@pytest.mark.cuda
@pytest.mark.parametrize("copy_ahead", [False, True], ids=["T1", "T2"])
async def test_on_a_gpu_a_step_never_makes_the_host_wait_for_the_device(copy_ahead: bool) -> None:
    """A blocking copy (or any other synchronising call) in the step would make the
    host wait for the previous step's kernels every step, so it could never run ahead
    of the GPU; torch's sync debug mode turns such a wait into an error."""
    model, opt = make(0, "sgd")
    pipe = basic(model.cuda(), opt, loss_fn=loss_fn, forward=forward,
                 prefetch=copy_ahead, memcpy_stream=copy_ahead)  # fmt: skip
    source = iter(batches(8))  # unpinned: the copy pins them first
    await pipe.progress(source)  # first-step set-up may synchronise
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            await pipe.progress(source)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(await collect(pipe, source)) == 2  # and the rest of the source trains
    pipe.shutdown()


async def test_a_thread_map_given_on_a_cpu_is_used_as_given() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, prefetch=True,
                                     memcpy_stream=True, thread_map={"h2d": "io"})  # fmt: skip
    assert lanes_of(pipe)["h2d"] == "io"
    pipe.shutdown()


async def test_an_executor_given_without_a_thread_map_keeps_the_preset_s_lanes() -> None:
    """Passing an executor to set another of its options changes no lane; an explicit
    ``"by_stream"`` is still one lane per stream."""
    model, opt = make(0, "sgd")
    options = dict(loss_fn=loss_fn, forward=forward, prefetch=True, memcpy_stream=True)
    pipe = basic(model, opt, executor=AsyncExecutor(slow_wait_s=None), **options)
    assert set(lanes_of(pipe).values()) == {"compute"}
    pipe.shutdown()
    pipe = basic(model, opt, executor=AsyncExecutor("by_stream"), **options)
    assert set(lanes_of(pipe).values()) == {"memcpy", "default"}
    pipe.shutdown()


@pytest.mark.parametrize("thread_map", ["by_stream", "per_task", {"h2d": "io"}, lambda t: "loop"])
async def test_every_thread_map_form_works(thread_map: object) -> None:
    data = batches(6)
    model, opt = make(0, "adam")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, prefetch=True,
                                     thread_map=thread_map)  # fmt: skip
    async with pipe:
        losses = [float(loss) for loss in await collect(pipe, iter(data))]
    assert losses == plain_loop(data, "adam")[0]


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_gradient_accumulation_is_explicit_and_exact(executor: str) -> None:
    data = batches(10)  # groups of 3: steps after batches 3, 6, 9 and the trailing 10th
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward,
                                     grad_accumulation=3, prefetch=True, executor=executor)  # fmt: skip
    async with pipe:
        losses = [float(loss) for loss in await collect(pipe, iter(data))]
    expected_losses, expected_params = plain_loop(data, "sgd", accumulate=3)
    assert losses == expected_losses
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="grad_accumulation"):
        basic(model, opt, loss_fn=loss_fn, grad_accumulation=0)


@pytest.mark.parametrize("drain_between", [False, True])
@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_a_pass_never_told_its_end_steps_its_partial_group_when_the_next_comes(
    executor: str, drain_between: bool
) -> None:
    # Exactly as many calls as batches: the end is read, never reported.  The partial
    # group of the first pass joined the second pass's first group.
    first, second = batches(7), batches(10)[7:]
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, grad_accumulation=3,
                 executor=executor)  # fmt: skip
    async with pipe:
        source = iter(first)
        losses = [float(await pipe.progress(source)) for _ in first]
        if drain_between:  # not the end, and does not hide the one read
            assert await pipe.drain() == []
        losses += [float(loss) for loss in await collect(pipe, iter(second))]  # told its end
    expected_losses, expected_params = plain_loop([], "sgd", 3, passes=[first, second])
    assert losses == expected_losses
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_step_calls_accumulate_like_one_pass(executor: str) -> None:
    # Each step() is a source of one batch: counted as a pass read to its end, it
    # stepped the optimizer after every batch.
    data = batches(6)  # groups of 3: steps after batches 3 and 6
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, grad_accumulation=3,
                 executor=executor)  # fmt: skip
    async with pipe:
        losses = [float(await pipe.step(batch)) for batch in data]
    expected_losses, expected_params = plain_loop(data, "sgd", accumulate=3)
    assert losses == expected_losses
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)


async def test_drain_leaves_a_partial_accumulation_group_to_the_next_batches() -> None:
    data = batches(6)
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward,
                                     grad_accumulation=3, prefetch=True)  # fmt: skip
    source = iter(data)
    async with pipe:
        # batch 2 in flight behind it, batch 3 read ahead: a group of 1 so far
        await pipe.progress(source)
        assert len(await pipe.drain()) == 2  # batches 2-3: a group of 3, one step
        # the same source continues; batches 4-6 make the next group
        rest = await collect(pipe, source)
    assert len(rest) == 3
    expected_params = plain_loop(data, "sgd", accumulate=3)[1]  # steps after 3 and 6
    for got, want in zip(model.parameters(), expected_params):
        assert torch.equal(got, want)


@pytest.mark.parametrize("executor", ["sequential", "async"])
@pytest.mark.parametrize("fails_in", ["forward", "backward_fn before", "backward"])
async def test_reset_after_a_failed_batch_keeps_or_drops_its_accumulation_group(
    executor: str, fails_in: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Groups of 3; batch 4 fails, with batch 3 of its group applied.  Failing in
    # forward, or in backward_fn before it calls loss.backward(), it touched no
    # gradient: the group goes on with batches 5 and 6.  Failing after its backward it
    # added to the group's gradients, which reset() then drops (and says so):
    # batches 5-7 make the next group.
    data = batches(9)
    model, opt = make(0, "sgd")
    calls = {"forward": 0, "backward_fn before": 0, "backward": 0}  # once per batch, in order

    def fail_at_batch_4(where: str) -> None:
        calls[where] += 1
        if where == fails_in and calls[where] == 5:
            raise ValueError("batch 4 is bad")

    def forward_failing(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        fail_at_batch_4("forward")
        return forward(model, batch)

    def backward_failing(loss: torch.Tensor) -> None:
        fail_at_batch_4("backward_fn before")
        loss.backward()
        fail_at_batch_4("backward")

    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward_failing,
                 backward_fn=backward_failing, grad_accumulation=3, executor=executor)  # fmt: skip
    batches_in = iter(data)
    async with pipe:
        assert len([await pipe.progress(batches_in) for _ in range(4)]) == 4
        with pytest.raises(ValueError, match="batch 4 is bad"):
            await pipe.progress(batches_in)
        pipe.reset()
        assert len(await collect(pipe, batches_in)) == 4  # batches 5-8
    dropped = [r.getMessage() for r in caplog.records if "were dropped" in r.getMessage()]
    groups = [[0, 1, 2], [5, 6, 7], [8]] if fails_in == "backward" else [[0, 1, 2], [3, 5, 6], [7, 8]]
    assert len(dropped) == (fails_in == "backward")
    if dropped:
        assert "batch 4 of the source failed after its backward" in dropped[0]
        assert "(of the 1 applied batch(es) before it)" in dropped[0]
    reference, reference_opt = make(0, "sgd")
    for group in groups:
        reference_opt.zero_grad()
        for i in group:
            (loss_fn(forward(reference, data[i]), data[i]) / 3).backward()
        reference_opt.step()
    for got, want in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, want)


async def test_loss_fn_may_return_a_tuple() -> None:
    model, opt = make(0, "sgd")

    def loss_and_mae(output: torch.Tensor, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return loss_fn(output, batch), (output - batch[1]).abs().mean()

    pipe = basic(model, opt, loss_fn=loss_and_mae, forward=forward)
    async with pipe:
        results = await collect(pipe, iter(batches(3)))
    assert all(isinstance(r, tuple) and len(r) == 2 for r in results)
    assert not any(t.requires_grad for r in results for t in r)
    assert [float(r[0]) for r in results] == plain_loop(batches(3), "sgd")[0]


async def test_one_argument_loss_fn_and_default_forward() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=lambda out: out.pow(2).mean())
    async with pipe:
        results = await collect(pipe, iter([torch.randn(4, 8) for _ in range(3)]))
    assert len(results) == 3 and all(r.ndim == 0 for r in results)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python >= 3.11")
@pytest.mark.parametrize("two_args", [False, True])
async def test_an_error_in_loss_fn_says_it_came_from_loss_fn(two_args: bool) -> None:
    model, opt = make(0, "sgd")

    def broken(output: torch.Tensor, *target: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad loss")

    loss = broken if two_args else (lambda output: broken(output))
    batch = batches(1) if two_args else [torch.randn(4, 8)]  # (inputs, target), or inputs
    pipe = basic(model, opt, loss_fn=loss)
    async with pipe:
        with pytest.raises(ValueError, match="bad loss") as caught:
            await pipe.progress(iter(batch))
    notes = caught.value.__notes__
    assert notes[0] == "aiopipe: raised by loss_fn, which basic() calls in its task 'forward'"
    assert "raised by task 'forward' on batch 0" in notes[1]  # the engine's own, after it


async def test_a_loss_that_is_not_a_tensor_is_a_clear_error() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=lambda out: "nope")
    async with pipe:
        with pytest.raises(PipelineError, match="loss_fn must return a tensor"):
            await pipe.progress(iter([torch.randn(4, 8)]))


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_step_feeds_one_batch_at_a_time(executor: str) -> None:
    data = batches(4)
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward, prefetch=True,
                                     executor=executor)  # fmt: skip
    async with pipe:
        losses = [float(await pipe.step(batch)) for batch in data]
    assert losses == plain_loop(data, "sgd")[0]


def test_blocking_step() -> None:
    data = batches(3)
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward).blocking()
    with pipe:
        assert [float(pipe.step(b)) for b in data] == plain_loop(data, "sgd")[0]


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Record:
    ids: torch.Tensor
    extras: dict[str, torch.Tensor]
    label: str = "keep"


def test_nested_batches_move_every_tensor_and_keep_their_structure() -> None:
    meta = torch.device("meta")  # a device every CPU build has: proves the tensors moved
    batch = {
        "pair": Pair(torch.ones(2), torch.zeros(3)),
        "list": [torch.ones(1), (torch.ones(2), "text")],
        "record": Record(torch.arange(3), {"w": torch.ones(2)}),
        "count": 7,
    }
    moved = move_to_device(batch, meta, non_blocking=True)
    assert isinstance(moved["pair"], Pair) and moved["pair"].x.device == meta
    assert moved["list"][0].device == meta and moved["list"][1][0].device == meta
    assert moved["list"][1][1] == "text"
    assert isinstance(moved["record"], Record) and moved["record"].ids.device == meta
    assert moved["record"].extras["w"].device == meta and moved["record"].label == "keep"
    assert moved["count"] == 7
    assert batch["pair"].x.device.type == "cpu"  # the original is untouched


def test_mappings_keep_their_type_and_state() -> None:
    batch = collections.defaultdict(list, {"x": torch.ones(2)})
    moved = move_to_device(batch, torch.device("meta"))
    assert isinstance(moved, collections.defaultdict) and moved.default_factory is list
    assert moved["x"].device.type == "meta" and batch["x"].device.type == "cpu"


def test_objects_with_a_to_method_are_moved_by_it() -> None:
    class Pipelineable:
        def __init__(self) -> None:
            self.calls: list[tuple[torch.device, bool]] = []

        def to(self, device: torch.device, non_blocking: bool = False) -> Pipelineable:
            self.calls.append((device, non_blocking))
            return self

    item = Pipelineable()
    assert move_to_device(item, torch.device("meta"), True) is item
    assert item.calls == [(torch.device("meta"), True)]


def changed_lines(before: str, after: str) -> list[str]:
    def code(text: str) -> list[str]:
        return text.split('"""', 2)[2].splitlines()  # without the module docstring

    diff = difflib.unified_diff(code(before), code(after), lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]


def test_migration_example_is_a_small_diff_with_identical_results() -> None:
    before, after = (EXAMPLES / "before.py").read_text(), (EXAMPLES / "after.py").read_text()
    changed = changed_lines(before, after)
    assert len(changed) <= 8, changed
    sys.path.insert(0, str(EXAMPLES))
    try:
        import after as after_module
        import before as before_module

        plain_model, plain_losses = before_module.train()
        piped_model, piped_losses = after_module.train()
    finally:
        sys.path.remove(str(EXAMPLES))
        for name in ("before", "after", "common"):
            sys.modules.pop(name, None)
    assert piped_losses == plain_losses
    for got, want in zip(piped_model.parameters(), plain_model.parameters()):  # type: ignore[attr-defined]
        assert torch.equal(got, want)
    # the example never calls shutdown(): dropping the pipeline stops its lanes
    del after_module
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name.startswith("aiopipe-lane") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "lanes of a dropped pipeline kept running"
        time.sleep(0.01)


# -- the loss without loss_fn, (inputs, target) pairs, backward/step hooks -------------------


def classification(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 8, generator=generator), torch.randint(0, 3, (16,), generator=generator))
            for _ in range(count)]  # fmt: skip


def classifier() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("preset", list(PRESETS))
async def test_inputs_target_pairs_work_with_a_loss_module_and_no_forward(preset: str) -> None:
    data = classification(6)
    model, opt = classifier()
    pipe = basic(model, opt, loss_fn=torch.nn.CrossEntropyLoss(),
                                     **PRESETS[preset])  # fmt: skip
    async with pipe:
        losses = [float(loss) for loss in await collect(pipe, iter(data))]
    plain_model, plain_opt = classifier()
    expected = []
    for inputs, target in data:
        plain_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(plain_model(inputs), target)
        loss.backward()
        plain_opt.step()
        expected.append(loss.item())
    assert losses == expected
    for got, want in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(got, want)


class SelfScoring(torch.nn.Module):
    """A model that computes its own loss from a dict batch and returns it as ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = torch.nn.Linear(8, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> object:
        output = self.net(batch["x"])
        loss = torch.nn.functional.mse_loss(output, batch["y"])
        if self.kind == "scalar":
            return loss
        if self.kind == "attribute":
            return collections.namedtuple("Output", "logits loss")(output, loss)
        if self.kind == "key":
            return {"logits": output, "loss": loss}
        return (loss, output)  # "first item"


@pytest.mark.parametrize("kind", ["scalar", "attribute", "key", "first item"])
async def test_without_loss_fn_the_loss_comes_from_the_output(kind: str) -> None:
    data = [{"x": x, "y": y} for x, y in batches(4)]
    torch.manual_seed(0)
    model = SelfScoring(kind)
    plain = SelfScoring("scalar")
    plain.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    pipe = basic(model, opt)
    async with pipe:
        results = await collect(pipe, iter(data))
    expected = []
    for batch in data:
        plain_opt.zero_grad()
        loss = plain(batch)
        loss.backward()
        plain_opt.step()
        expected.append(loss.item())
    assert all(isinstance(r, torch.Tensor) and not r.requires_grad for r in results)
    assert [float(r) for r in results] == expected
    assert torch.equal(model.net.weight, plain.net.weight)


async def test_an_output_that_is_not_a_loss_says_what_to_pass() -> None:
    model, opt = make(0, "sgd")  # returns (batch, 1) predictions, not a loss
    pipe = basic(model, opt)
    async with pipe:
        with pytest.raises(PipelineError, match=r"tensor of shape \(4, 1\).*Pass loss_fn="):
            await pipe.progress(iter([torch.randn(4, 8)]))


async def test_a_pair_given_whole_to_the_model_gets_a_hint() -> None:
    model, opt = make(0, "sgd")
    pipe = basic(model, opt, loss_fn=lambda output: output.sum())
    async with pipe:
        with pytest.raises(TypeError) as caught:
            await pipe.progress(iter(batches(1)))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "(inputs, target) pair" in notes and "loss_fn=torch.nn.CrossEntropyLoss()" in notes


async def test_a_two_argument_loss_given_the_whole_batch_gets_a_hint() -> None:
    # CrossEntropyLoss on plain tensor batches: the batch was taken as the target, and
    # torch's own error said nothing of why.
    model = torch.nn.Linear(4, 3)
    pipe = basic(model, torch.optim.SGD(model.parameters(), lr=0.1),
                 loss_fn=torch.nn.CrossEntropyLoss())  # fmt: skip
    async with pipe:
        with pytest.raises(RuntimeError) as caught:
            await pipe.progress(iter([torch.randn(8, 4)]))
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "called loss_fn(output, batch) with the whole batch" in notes
    assert "(inputs, target) pairs" in notes


async def test_a_loss_of_more_than_one_value_says_to_reduce_it() -> None:
    # torch said only "grad can be implicitly created only for scalar outputs"
    model = torch.nn.Linear(4, 3)
    pipe = basic(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda out: out)
    async with pipe:
        with pytest.raises(PipelineError, match=r"shape \(8, 3\), not one value.*\.mean\(\)"):
            await pipe.progress(iter([torch.randn(8, 4)]))


@pytest.mark.parametrize("executor", ["sequential", "async"])
async def test_clipping_through_the_step_hook_equals_the_plain_loop(executor: str) -> None:
    data = batches(10)  # groups of 3: steps after batches 3, 6, 9 and the trailing 10th
    model, opt = make(0, "sgd")
    backward_losses: list[float] = []
    stepped: list[torch.optim.Optimizer] = []

    def backward_fn(loss: torch.Tensor) -> None:
        backward_losses.append(loss.item())
        loss.backward()

    def clip_and_step(optimizer: torch.optim.Optimizer) -> None:
        stepped.append(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()

    pipe = basic(model, opt, loss_fn=loss_fn, forward=forward,
                                     backward_fn=backward_fn, optimizer_step_fn=clip_and_step,
                                     grad_accumulation=3, prefetch=True, executor=executor)  # fmt: skip
    async with pipe:
        losses = [float(loss) for loss in await collect(pipe, iter(data))]

    plain_model, plain_opt = make(0, "sgd")
    expected = []
    for i, batch in enumerate(data):
        if i % 3 == 0:
            plain_opt.zero_grad()
        loss = loss_fn(forward(plain_model, batch), batch)
        (loss / 3).backward()
        if (i + 1) % 3 == 0 or i == len(data) - 1:
            torch.nn.utils.clip_grad_norm_(plain_model.parameters(), 0.05)
            plain_opt.step()
        expected.append(loss.item())
    assert losses == expected
    assert backward_losses == [float(torch.tensor(v) / 3) for v in expected]  # the scaled loss
    assert stepped == [opt] * 4
    for got, want in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(got, want)
