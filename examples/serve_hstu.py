"""Serve HSTU ranking over HTTP: requests are micro-batched into an aiopipe eval pipeline.

    python examples/serve_hstu.py --port 8080
    curl -s 127.0.0.1:8080/rank -d '{"items": [5, 17], "actions": [1, 0], "candidates": [42, 7]}'
    python examples/serve_load.py --spawn --requests 2000 --concurrency 64

``POST /rank`` takes one user -- history ``items`` with one ``actions`` entry each, and
the ``candidates`` to rank -- and answers ``{"scores": [[p_0, p_1, p_2], ...]}``: per
candidate, the probability of each task.  ``GET /stats`` reports the requests served
and the batch-size histogram; ``GET /health`` answers ``ok``.  Every error answer is
``{"error": "..."}``: ``400`` malformed request, ``413`` body over 1 MiB, ``500`` the
model failed on the request's batch, ``503`` shutting down.

On SIGTERM the server stops accepting connections, answers the requests queued and in
flight, answers ``503`` to new requests on connections already open, then exits 0.

Design (docs/serving.md): handlers queue their request with a future and wait; a
``MicroBatcher`` is the pipeline's async source -- while the model is idle it waits for
a first request and up to ``--max-wait-ms`` for more (at most ``--max-batch``); while a
batch is in flight it takes whatever has queued meanwhile without waiting.  Three
tasks run each batch: ``collate`` (lookahead 1, lane ``io``: builds the jagged batch
of the next request group while the current one is in the model), ``forward`` (lane
``compute``, ``torch.inference_mode``) and ``scatter`` (on the event loop, which owns
the futures: each request gets its own rows).  The model is the unsharded HSTU
ranking model of ``hstu_tasks``: a single process needs no process group.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web
from aiohttp.typedefs import Handler
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import aiopipe
from aiopipe import Pipeline, Task, TaskContext
from hstu_tasks import DataConfig, HSTUBatch, HSTURankingModel, ModelConfig, quiet_torchrec

THREAD_MAP = {"collate": "io", "forward": "compute", "scatter": "loop"}
TEST_GATE_ENV = "SERVE_HSTU_TEST_GATE"


@dataclass(frozen=True)
class ServeConfig:
    max_batch: int = 8
    max_wait_ms: float = 2.0
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)


@dataclass(frozen=True)
class RankRequest:
    """One user: history items and actions (same length) and candidate items."""

    items: tuple[int, ...]
    actions: tuple[int, ...]
    candidates: tuple[int, ...]

    @classmethod
    def parse(cls, body: Any, config: ServeConfig) -> RankRequest:
        """Validate a decoded JSON body; ``ValueError`` says what is wrong."""
        if not isinstance(body, dict):
            raise ValueError('expected a JSON object {"items", "actions", "candidates"}')
        fields = {}
        for name, bound in (("items", config.data.num_items), ("actions", config.data.num_actions),
                            ("candidates", config.data.num_items)):  # fmt: skip
            values = body.get(name)
            if not isinstance(values, list) or not values:
                raise ValueError(f"{name!r} must be a non-empty list of integers")
            if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < bound
                       for v in values):  # fmt: skip
                raise ValueError(f"{name!r} must hold integers in [0, {bound})")
            fields[name] = tuple(values)
        if len(fields["items"]) != len(fields["actions"]):
            raise ValueError("'items' and 'actions' must have the same length: one action per item")
        tokens = 2 * len(fields["items"]) + len(fields["candidates"])
        if tokens > config.model.max_positions:
            raise ValueError(
                f"2 * len(items) + len(candidates) = {tokens} exceeds the model's "
                f"{config.model.max_positions} positions"
            )
        return cls(fields["items"], fields["actions"], fields["candidates"])


@dataclass
class Pending:
    request: RankRequest
    future: asyncio.Future[list[list[float]]]


def collate(requests: Sequence[RankRequest]) -> HSTUBatch:
    """One jagged batch: per user, the ``item`` feature is history then candidates."""
    items = [v for r in requests for v in (*r.items, *r.candidates)]
    actions = [v for r in requests for v in r.actions]
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"],
        values=torch.tensor(items + actions, dtype=torch.long),
        lengths=torch.tensor([len(r.items) + len(r.candidates) for r in requests]
                             + [len(r.actions) for r in requests]),
    )  # fmt: skip
    num_candidates = torch.tensor([len(r.candidates) for r in requests])
    labels = torch.zeros(int(num_candidates.sum()), dtype=torch.long)  # unused in serving
    return HSTUBatch(features, num_candidates, labels)


def build_model(config: ServeConfig) -> HSTURankingModel:
    """The ranking model, unsharded on CPU, in eval mode (deterministic from the seed)."""
    torch.manual_seed(config.seed)
    model = HSTURankingModel(config.model, config.data, embedding_device="cpu")
    return model.eval()


def scores(model: HSTURankingModel, batch: HSTUBatch) -> torch.Tensor:
    """Per candidate, the probability of each task: ``[candidates, tasks]``."""
    with torch.inference_mode():
        _, logits = model(batch)
    return torch.sigmoid(logits)


class ForwardGate:
    """Test-only hook that holds each batch before the model, so a test can keep
    requests in flight for as long as it needs.  Enabled by the environment variable
    ``SERVE_HSTU_TEST_GATE=HELD_FD:RELEASE_FD`` (two pipe ends the server inherits):
    before each forward the batch's request count is written to HELD_FD as a line, then
    the model waits for one byte on RELEASE_FD; once RELEASE_FD reaches end of file,
    every batch passes."""

    def __init__(self, held_fd: int, release_fd: int) -> None:
        self._held = os.fdopen(held_fd, "w", buffering=1)  # line-buffered: one line per batch
        self._release_fd = release_fd
        self._released = False

    @classmethod
    def from_environ(cls) -> ForwardGate | None:
        value = os.environ.get(TEST_GATE_ENV)
        if not value:
            return None
        try:
            held_fd, release_fd = (int(fd) for fd in value.split(":"))
        except ValueError:
            raise SystemExit(f"{TEST_GATE_ENV}={value!r}: expected HELD_FD:RELEASE_FD") from None
        return cls(held_fd, release_fd)

    def wait(self, requests: int) -> None:
        """On the compute lane: announce the batch, then block until released."""
        if self._released:
            return
        self._held.write(f"{requests}\n")
        self._released = os.read(self._release_fd, 1) == b""


class ServiceClosed(RuntimeError):
    """The service is shutting down and takes no new requests."""


class MicroBatcher:
    """The pipeline's source: lists of pending requests, ``[]`` when nothing has
    queued but a batch in flight must move on (see the module docstring)."""

    def __init__(self, max_batch: int, max_wait_s: float) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self._closed = False
        #: Non-empty batches handed to the pipeline whose results are not scattered yet.
        self.in_flight: collections.deque[list[Pending]] = collections.deque()

    def submit(self, pending: Pending) -> None:
        if self._closed:
            raise ServiceClosed("the service is shutting down")
        self._queue.append(pending)
        self._arrived.set()

    def close(self) -> None:
        """No new requests; the queued ones are still served, then the source ends."""
        self._closed = True
        self._arrived.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncIterator[list[Pending]]:
        return self

    async def __anext__(self) -> list[Pending]:
        queue = self._queue
        if not self.in_flight:  # the model is idle: wait for work, then briefly for company
            while not queue and not self._closed:
                await self._next_arrival()
            deadline = time.monotonic() + self.max_wait_s
            while 0 < len(queue) < self.max_batch and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:  # an Event, not Queue.get, under the timeout: no item can be lost
                    await asyncio.wait_for(self._next_arrival(), left)
                except asyncio.TimeoutError:
                    break
        batch = [queue.popleft() for _ in range(min(len(queue), self.max_batch))]
        if batch:
            self.in_flight.append(batch)
        elif self._closed:
            raise StopAsyncIteration  # the pipeline finishes the batches in flight
        return batch

    def _next_arrival(self) -> Coroutine[Any, Any, bool]:
        """Wait for the next ``submit``.  Cleared here, before the caller yields: under
        ``wait_for`` (a task of its own, started a loop turn later) a clear inside the
        coroutine would erase a request that arrived in that turn, and the batch would
        wait out ``max_wait_s`` for company it already has."""
        self._arrived.clear()
        return self._arrived.wait()

    def recover(self, exc: BaseException) -> None:
        """After a task failed: the requests of the batch it was working on get
        ``exc``; the other batches in flight go back to the front of the queue."""
        batches = list(self.in_flight)
        self.in_flight.clear()
        failed_task = getattr(exc, "aiopipe_task", None)  # attached by the engine
        if failed_task == "collate":  # the newest batch (collate never fails on [])
            failed, retried = batches[-1:], batches[:-1]
        elif failed_task in ("forward", "scatter"):  # the oldest: offset 0
            failed, retried = batches[:1], batches[1:]
        else:
            failed, retried = batches, []
        for pending in (p for batch in failed for p in batch):
            if not pending.future.done():
                pending.future.set_exception(exc)
        self._queue.extendleft(reversed([p for batch in retried for p in batch]))
        self._arrived.set()


class RankingService:
    """The eval pipeline, its micro-batcher and statistics."""

    def __init__(self, model: HSTURankingModel, config: ServeConfig,
                 gate: ForwardGate | None = None) -> None:  # fmt: skip
        self.model = model
        self.config = config
        self.gate = gate
        self._serving: asyncio.Task[None] | None = None  # started by the app's lifespan
        self.batcher = MicroBatcher(config.max_batch, config.max_wait_ms / 1e3)
        self.histogram: collections.Counter[int] = collections.Counter()
        self.forward_seconds = 0.0  # time in the model, summed over batches
        self.pipeline = Pipeline(
            [
                Task.from_fn("collate", self._collate, lookahead=1, writes=("batch",)),
                Task.from_fn("forward", self._forward, reads=("batch",), writes=("scores",)),
                Task.from_fn("scatter", self._scatter, reads=("scores",),
                             writes=("step_result",)),
            ],  # fmt: skip
            thread_map=THREAD_MAP,
            # The batcher forms each micro-batch when the pipeline asks for it, so the
            # requests that arrived during the last step join it; reading ahead would
            # fix the next batch (often empty) at the start of each step instead.
            read_ahead=False,
        )

    def _collate(self, ctx: TaskContext) -> None:
        pending: list[Pending] = ctx.slots["batch_cpu"]
        ctx.slots.set("batch", collate([p.request for p in pending]) if pending else None)

    def _forward(self, ctx: TaskContext) -> None:
        batch = ctx.slots["batch"]
        if batch is None:
            ctx.slots.set("scores", None)
            return
        if self.gate is not None:
            self.gate.wait(len(batch.num_candidates))
        start = time.perf_counter()
        ctx.slots.set("scores", scores(self.model, batch))
        self.forward_seconds += time.perf_counter() - start  # one lane writes it

    def _scatter(self, ctx: TaskContext) -> None:
        """On the event loop (lane "loop"): the futures belong to it."""
        pending: list[Pending] = ctx.slots["batch_cpu"]
        ctx.slots.set("step_result", len(pending))
        if not pending:
            return
        rows = ctx.slots["scores"].split([len(p.request.candidates) for p in pending])
        for item, row in zip(pending, rows):
            if not item.future.done():  # the client may have gone away
                item.future.set_result(row.tolist())
        self.batcher.in_flight.popleft()
        self.histogram[len(pending)] += 1

    async def rank(self, request: RankRequest) -> list[list[float]]:
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        self.batcher.submit(Pending(request, future))
        return await future

    async def serve(self) -> None:
        """Run batches until the batcher is closed and every queued request answered."""
        while True:
            try:
                async for _ in self.pipeline.results(self.batcher):
                    pass
                return
            except Exception as exc:  # a batch failed: answer its requests, keep serving
                self.batcher.recover(exc)
                self.pipeline.reset()

    def statistics(self) -> dict[str, Any]:
        batches = sum(self.histogram.values())
        served = sum(size * count for size, count in self.histogram.items())
        return {
            "requests": served,
            "batches": batches,
            "mean_batch_size": served / batches if batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "forward_seconds": self.forward_seconds,
            "max_batch": self.config.max_batch,
            "max_wait_ms": self.config.max_wait_ms,
        }

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        """aiohttp cleanup context: serve while the app runs, then drain and stop."""
        self._serving = asyncio.create_task(self.serve())
        yield
        try:
            await self.drain()
        finally:
            self.pipeline.shutdown()

    async def drain(self) -> None:
        """Refuse new requests (``ServiceClosed``); return once every request queued or
        in flight is answered."""
        self.batcher.close()
        if self._serving is not None:
            # Shielded: a cancelled drain (Ctrl-C) must not cancel serving, which the
            # cleanup context still awaits.
            await asyncio.shield(self._serving)


SERVICE = web.AppKey("service", RankingService)


def error_response(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def decode_json(body: bytes) -> Any:
    """``json.loads`` whose every failure is a ``ValueError`` (a 400, not a 500)."""
    try:
        return json.loads(body)
    except RecursionError:  # e.g. 200 KB of "[[[..."
        raise ValueError("the JSON body is nested too deeply") from None


async def handle_rank(request: web.Request) -> web.Response:
    service = request.app[SERVICE]
    try:  # a body over client_max_size (1 MiB) raises 413 here: see json_errors
        ranked = RankRequest.parse(decode_json(await request.read()), service.config)
    except ValueError as exc:  # includes malformed JSON
        return error_response(400, str(exc))
    try:
        result = await service.rank(ranked)
    except ServiceClosed as exc:
        return error_response(503, str(exc))
    except Exception as exc:  # the model failed on this request's batch
        return error_response(500, f"{type(exc).__name__}: {exc}")
    return web.json_response({"scores": result})


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own error answers (413 body too large, 404, 405) in the documented
    ``{"error": ...}`` form."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.text or exc.reason)
        if "Allow" in exc.headers:  # 405 names the methods the route takes
            response.headers["Allow"] = exc.headers["Allow"]
        return response


@web.middleware
async def close_while_draining(request: web.Request, handler: Handler) -> web.StreamResponse:
    """During the drain every answer says "Connection: close", so a client opens a new
    connection for its next request (refused at once) instead of sending it down one
    that the server is about to close (reset, with the request lost in between)."""
    response = await handler(request)
    if request.app[SERVICE].batcher.closed:
        response.force_close()
    return response


async def handle_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].statistics())


async def handle_health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def create_app(config: ServeConfig, model: HSTURankingModel | None = None,
               gate: ForwardGate | None = None) -> web.Application:  # fmt: skip
    service = RankingService(model if model is not None else build_model(config), config, gate)
    app = web.Application(middlewares=[close_while_draining, json_errors])
    app[SERVICE] = service
    app.cleanup_ctx.append(service.lifespan)
    app.add_routes([web.post("/rank", handle_rank), web.get("/stats", handle_stats),
                    web.get("/health", handle_health)])  # fmt: skip
    return app


async def serve_forever(config: ServeConfig, host: str, port: int,
                        gate: ForwardGate | None = None) -> None:  # fmt: skip
    app = create_app(config, gate=gate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server((host, port))
    site = web.SockSite(runner, sock)
    await site.start()
    bound_host, bound_port = sock.getsockname()[:2]
    print(f"serving on http://{bound_host}:{bound_port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()  # Ctrl-C cancels this; SIGTERM sets it
        await site.stop()  # new connections are refused from here on
        print("draining: answering the requests in flight, 503 for new ones", flush=True)
        # Before runner.cleanup, which closes the idle keep-alive connections first and
        # runs the app's cleanup (closing the batcher) last: a request arriving on an
        # open connection during the drain gets a 503, not a closed connection.
        await app[SERVICE].drain()
    finally:
        await runner.cleanup()  # closes the connections, stops the pipeline's lanes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--max-batch", type=int, default=8, help="requests per forward at most")
    parser.add_argument("--max-wait-ms", type=float, default=2.0,
                        help="how long a batch waits for more requests")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="model weights")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="intra-op threads: the lanes already use a core each")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    quiet_torchrec()
    torch.set_num_threads(args.torch_threads)
    config = ServeConfig(max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, seed=args.seed)
    try:
        aiopipe.run(serve_forever(config, args.host, args.port, ForwardGate.from_environ()))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
