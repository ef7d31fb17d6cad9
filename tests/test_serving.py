"""The HTTP serving example: real requests on loopback, answers checked against the
model run on each request alone, micro-batching visible in /stats.

Tolerance: a request's scores inside a batch equal the model's scores for that
request alone to ``atol=1e-5`` (float32; per-sample attention is normalised by the
sample's own length and padding is masked, so only the matmul blocking of different
shapes differs -- about 1e-7 in practice).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from aiohttp import ClientSession, TCPConnector, web
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from hstu_tasks import HSTUBatch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
ATOL = 1e-5
STARTUP_S = 90.0  # bound on a server process importing torch and torchrec on a busy machine
DEADLINE_S = 30.0  # bound on each other wait for the server process


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


serve = load_example("serve_hstu")
load = load_example("serve_load")


@pytest.fixture(scope="module")
def model() -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what the example's main() does: the lanes use the cores
    yield serve.build_model(serve.ServeConfig())
    torch.set_num_threads(threads)


class Server:
    def __init__(self, runner: web.AppRunner, url: str) -> None:
        self.runner = runner
        self.url = url
        self.service = runner.app[serve.SERVICE]


@pytest.fixture
async def server(model: Any) -> AsyncIterator[Server]:
    app = serve.create_app(serve.ServeConfig(max_batch=8, max_wait_ms=20.0), model)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield Server(runner, f"http://127.0.0.1:{sock.getsockname()[1]}")
    finally:
        await runner.cleanup()  # idempotent: a test may have stopped it already


def alone(model: Any, body: dict[str, list[int]]) -> torch.Tensor:
    """The model's scores for one request, collated here independently of the example."""
    items = body["items"] + body["candidates"]
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=["item", "action"],
        values=torch.tensor(items + body["actions"]),
        lengths=torch.tensor([len(items), len(body["actions"])]),
    )
    count = len(body["candidates"])
    batch = HSTUBatch(features, torch.tensor([count]), torch.zeros(count, dtype=torch.long))
    with torch.inference_mode():
        _, logits = model(batch)
    return torch.sigmoid(logits)


async def post_all(url: str, bodies: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    async with ClientSession(url) as session:

        async def post(body: dict[str, Any]) -> tuple[int, Any]:
            async with session.post("/rank", json=body) as response:
                return response.status, await response.json()

        return await asyncio.gather(*(post(body) for body in bodies))


async def test_batched_answers_equal_the_model_on_each_request_alone(
    server: Server, model: Any
) -> None:
    bodies = load.make_requests(40, seed=3)
    answers = await post_all(server.url, bodies)
    for body, (status, answer) in zip(bodies, answers):
        assert status == 200, answer
        scores = torch.tensor(answer["scores"])
        assert scores.shape == (len(body["candidates"]), 3)
        torch.testing.assert_close(scores, alone(model, body), rtol=0, atol=ATOL)
    async with ClientSession(server.url) as session, session.get("/stats") as response:
        stats = await response.json()
    histogram = {int(size): count for size, count in stats["batch_size_histogram"].items()}
    assert sum(size * count for size, count in histogram.items()) == stats["requests"] == 40
    assert max(histogram) > 1, histogram  # requests really shared batches...
    assert max(histogram) <= 8 and stats["batches"] < 40  # ...never beyond max_batch


async def test_bad_requests_get_400_and_the_service_keeps_serving(server: Server) -> None:
    good = {"items": [1, 2, 3], "actions": [0, 1, 2], "candidates": [4, 5]}
    bad = [
        [1, 2],  # not an object
        {**good, "actions": [0, 1]},  # one action per item
        {**good, "candidates": [2000]},  # out of the item table
        {**good, "items": []},
        {**good, "items": [1] * 120, "actions": [0] * 120, "candidates": [1] * 20},  # > 256
    ]
    answers = await post_all(server.url, [*bad, good])
    assert [status for status, _ in answers] == [400] * len(bad) + [200]
    assert all("error" in answer for _, answer in answers[:-1])
    async with ClientSession(server.url) as session:
        for body, status in [(b"{not json", 400),
                             (b"[" * 100_000 + b"]" * 100_000, 400),  # nested too deeply
                             (b" " * (2**20 + 1), 413)]:  # over aiohttp's 1 MiB limit  # fmt: skip
            async with session.post("/rank", data=io.BytesIO(body)) as response:
                assert response.status == status
                assert "error" in await response.json()  # the documented error body
        async with session.get("/rank") as response:  # aiohttp's own errors as well
            assert response.status == 405 and "error" in await response.json()
        async with session.post("/rank", json=good) as response:
            assert response.status == 200


async def test_a_failing_batch_gets_an_error_and_the_service_recovers(
    server: Server, model: Any
) -> None:
    poison = 1999  # a candidate id that makes the model fail

    def flaky(batch: HSTUBatch) -> Any:
        if poison in batch.features["item"].values().tolist():
            raise ValueError("poisoned batch")
        return model(batch)

    server.service.model = flaky
    bad = {"items": [1], "actions": [0], "candidates": [poison]}
    good = {"items": [1, 2], "actions": [0, 1], "candidates": [3]}
    [(status, answer)] = await post_all(server.url, [bad])
    assert status == 500 and "poisoned batch" in answer["error"]
    [(status, answer)] = await post_all(server.url, [good])  # the pipeline was reset
    assert status == 200
    torch.testing.assert_close(torch.tensor(answer["scores"]), alone(model, good), atol=ATOL,
                               rtol=0)  # fmt: skip


async def test_a_request_arriving_while_the_batcher_starts_waiting_joins_the_batch() -> None:
    """Company arriving in any loop turn after the first request fills the batch at
    once (it must not wait out max_wait_s with both requests queued)."""
    loop = asyncio.get_running_loop()
    request = serve.RankRequest((1,), (0,), (2,))
    for turns in range(4):  # the second request arrives after 0..3 loop turns
        batcher = serve.MicroBatcher(max_batch=2, max_wait_s=600.0)
        first, second = (serve.Pending(request, loop.create_future()) for _ in range(2))
        batcher.submit(first)
        batch = asyncio.ensure_future(batcher.__anext__())
        for _ in range(turns):
            await asyncio.sleep(0)  # one loop turn, no time
        batcher.submit(second)
        assert await asyncio.wait_for(batch, DEADLINE_S) == [first, second], turns


async def test_after_a_failure_the_other_batches_in_flight_are_retried() -> None:
    batcher = serve.MicroBatcher(max_batch=2, max_wait_s=0.0)
    loop = asyncio.get_running_loop()
    request = serve.RankRequest((1,), (0,), (2,))
    pending = [serve.Pending(request, loop.create_future()) for _ in range(5)]
    for item in pending:
        batcher.submit(item)
    assert await batcher.__anext__() == pending[:2]
    assert await batcher.__anext__() == pending[2:4]  # in flight: taken without waiting
    failure = ValueError("model failed")
    failure.aiopipe_task = "forward"  # type: ignore[attr-defined]  # as the engine attaches
    batcher.recover(failure)  # forward works on the oldest batch
    assert [p.future.exception() for p in pending[:2]] == [failure, failure]
    assert not any(p.future.done() for p in pending[2:])
    assert await batcher.__anext__() == pending[2:4]  # retried first, in order
    failure.aiopipe_task = "collate"  # type: ignore[attr-defined]
    assert await batcher.__anext__() == pending[4:]
    batcher.recover(failure)  # collate works on the newest batch
    assert pending[4].future.exception() is failure
    assert await batcher.__anext__() == pending[2:4]
    assert await batcher.__anext__() == []  # nothing queued, a batch in flight: no waiting
    batcher.close()
    with pytest.raises(serve.ServiceClosed):
        batcher.submit(pending[0])
    with pytest.raises(StopAsyncIteration):  # the pipeline then finishes pending[2:4]
        await batcher.__anext__()


async def test_shutdown_answers_the_queued_requests_then_refuses(server: Server) -> None:
    service = server.service
    requests = [serve.RankRequest.parse(body, service.config) for body in load.make_requests(20)]
    waiting = [asyncio.ensure_future(service.rank(request)) for request in requests]
    await asyncio.sleep(0)  # queued, mostly not yet batched
    await server.runner.cleanup()  # closes the batcher, serves the queue, stops the lanes
    answers = await asyncio.gather(*waiting)
    assert [len(a) for a in answers] == [len(r.candidates) for r in requests]
    with pytest.raises(serve.ServiceClosed):
        await service.rank(requests[0])
    assert service.pipeline.statistics().closed


async def test_the_load_generator_reports_throughput_latency_and_batches(server: Server) -> None:
    report = await load.run_load(server.url, load.make_requests(60, seed=5), concurrency=16)
    assert report.errors == 0 and report.requests == 60
    assert 0 < report.p50_ms <= report.p99_ms and report.throughput_rps > 0
    assert report.server["requests"] == 60  # the batches of this run only
    with pytest.raises(SystemExit, match="loopback"):
        load.require_loopback("http://192.0.2.1:8080")


async def pipe_reader(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    return reader, transport


async def start_gated_server(
    stderr: Any, *args: str
) -> tuple[asyncio.subprocess.Process, asyncio.StreamReader, asyncio.BaseTransport, int]:
    """A serve_hstu.py process holding each batch before the model (its test gate):
    the process, the reader of the batches it holds, that reader's transport and the
    pipe end to write one byte per batch to let through (closing it lets all pass)."""
    held_read, held_write = os.pipe()
    release_read, release_write = os.pipe()
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLES / "serve_hstu.py"), "--port", "0", *args,
        env={**os.environ, serve.TEST_GATE_ENV: f"{held_write}:{release_read}"},
        pass_fds=(held_write, release_read), stdout=asyncio.subprocess.PIPE, stderr=stderr,
    )  # fmt: skip
    os.close(held_write)
    os.close(release_read)
    held, held_transport = await pipe_reader(held_read)
    return process, held, held_transport, release_write


async def server_url(process: asyncio.subprocess.Process) -> str:
    """The address the server prints once it listens."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), STARTUP_S)
    assert line.startswith(b"serving on "), line
    return line.decode().split()[-1]


async def rank(session: ClientSession, body: dict[str, Any]) -> tuple[int, Any, str | None]:
    """Status, decoded body and ``Connection`` header of one ``POST /rank``."""
    async with session.post("/rank", json=body) as response:
        return response.status, await response.json(), response.headers.get("Connection")


@pytest.mark.one_loop  # the server runs in its own process, on its own loop
@pytest.mark.timeout(STARTUP_S + 4 * DEADLINE_S)
async def test_sigterm_answers_requests_in_flight_and_503s_new_ones(
    tmp_path: Path, model: Any
) -> None:
    """A real server process and real SIGTERM; the test holds a batch in the model
    (serve_hstu's test gate) to make "a request arrives during the drain" certain."""
    with open(tmp_path / "stderr", "w+") as stderr:
        # the three requests: one batch
        process, held, held_transport, release_write = await start_gated_server(
            stderr, "--max-batch", "3", "--max-wait-ms", "600000"
        )
        try:
            url = await server_url(process)
            bodies = load.make_requests(3, seed=11)
            keep_alive = TCPConnector(keepalive_timeout=STARTUP_S)  # outlives the test's waits
            async with ClientSession(url) as busy, ClientSession(url, connector=keep_alive) as idle:
                in_flight = [asyncio.ensure_future(rank(busy, body)) for body in bodies]
                assert await asyncio.wait_for(held.readline(), DEADLINE_S) == b"3\n"
                async with idle.get("/health") as response:  # leaves an open connection
                    assert await response.text() == "ok"

                process.send_signal(signal.SIGTERM)
                line = await asyncio.wait_for(process.stdout.readline(), DEADLINE_S)
                assert line.startswith(b"draining"), line
                host, port = url.removeprefix("http://").split(":")
                with pytest.raises(ConnectionRefusedError):  # no new connections...
                    await asyncio.open_connection(host, int(port))
                status, answer, connection = await rank(idle, bodies[0])  # on open ones: 503
                assert (status, connection) == (503, "close")
                assert "shutting down" in answer["error"]
                assert not any(request.done() for request in in_flight)  # still in the model

                os.close(release_write)
                release_write = -1
                answers = await asyncio.wait_for(asyncio.gather(*in_flight), DEADLINE_S)
            for body, (status, answer, connection) in zip(bodies, answers):
                assert (status, connection) == (200, "close"), answer  # answered in the drain
                torch.testing.assert_close(torch.tensor(answer["scores"]), alone(model, body),
                                           rtol=0, atol=ATOL)  # fmt: skip
            assert await asyncio.wait_for(process.wait(), DEADLINE_S) == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            held_transport.close()
            if release_write >= 0:
                os.close(release_write)
            stderr.seek(0)
            log = stderr.read()
        assert "Traceback" not in log, log


@pytest.mark.one_loop  # the server runs in its own process, on its own loop
@pytest.mark.timeout(STARTUP_S + 3 * DEADLINE_S)
async def test_the_load_generator_counts_a_server_gone_mid_run_as_errors(tmp_path: Path) -> None:
    """The server process dies while the load runs: the requests it dropped and those
    it then refused are counted per client, and a report still comes back."""
    with open(tmp_path / "stderr", "w+") as stderr:
        process, held, held_transport, release_write = await start_gated_server(
            stderr, "--max-batch", "2", "--max-wait-ms", "600000"  # a batch: one per client
        )
        try:
            url = await server_url(process)
            load_run = asyncio.ensure_future(
                load.run_load(url, load.make_requests(8, seed=3), concurrency=2)
            )
            assert await asyncio.wait_for(held.readline(), DEADLINE_S) == b"2\n"
            os.write(release_write, b"x")  # the first two requests are answered...
            # ...which both clients have read once they sent the second batch
            assert await asyncio.wait_for(held.readline(), DEADLINE_S) == b"2\n"
            process.kill()  # the server dies holding it
            await process.wait()
            report = await asyncio.wait_for(load_run, DEADLINE_S)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            held_transport.close()
            os.close(release_write)
    assert (report.requests, report.errors) == (8, 6)
    assert len(report.client_errors) == 2 and sum(report.client_errors) == 6
    assert min(report.client_errors) >= 1  # each lost its request in the dead batch
    assert sum(report.error_kinds.values()) == 6
    assert not any(kind.startswith("http") for kind in report.error_kinds)
    assert report.server == {}  # nobody answered /stats at the end
    assert report.p50_ms > 0  # the two answered requests
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        load.print_report(report)
    assert "(6 errors, " in output.getvalue() and "stopped answering" in output.getvalue()


@contextlib.contextmanager
def refused_url() -> Iterator[str]:
    """A loopback port that is bound but not listening: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_the_load_generator_says_in_one_line_that_no_server_answers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A raw ClientConnectorError traceback from the first GET /stats.
    with refused_url() as url:
        monkeypatch.setattr(sys, "argv", ["serve_load.py", "--url", url, "--warmup", "0"])
        with pytest.raises(SystemExit) as exited:
            load.main()
    message = str(exited.value.code)
    assert message.startswith(f"serve_load: the server at {url} is not reachable: ")
    assert "\n" not in message and capsys.readouterr().out == ""


@pytest.mark.parametrize("option", [("--concurrency", "0"), ("--requests", "0"),
                                    ("--requests", "-1"), ("--warmup", "-1")])  # fmt: skip
def test_the_load_generator_refuses_no_clients_or_requests(
    option: tuple[str, str], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # --concurrency 0 sent nothing and reported NaN latencies; --requests -1 as many.
    with refused_url() as url:
        monkeypatch.setattr(sys, "argv", ["serve_load.py", "--url", url, *option])
        with pytest.raises(SystemExit) as exited:
            load.main()
    assert exited.value.code == 2
    assert f"argument {option[0]}: must be >= " in capsys.readouterr().err


async def test_the_load_report_has_no_nan_when_no_request_was_answered() -> None:
    # p50/p99 were NaN, and the JSON line said NaN, which JSON readers refuse.
    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"batch_size_histogram": {}, "forward_seconds": 0.0})

    async def rank(request: web.Request) -> web.Response:
        return web.json_response({"error": "shutting down"}, status=503)

    app = web.Application()
    app.router.add_get("/stats", stats)
    app.router.add_post("/rank", rank)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        report = await load.run_load(url, load.make_requests(4, seed=1), concurrency=2)
    finally:
        await runner.cleanup()
    assert (report.errors, report.error_kinds) == (4, {"http 503": 4})
    assert report.p50_ms is None and report.p99_ms is None
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        load.print_report(report)
    lines = output.getvalue().splitlines()

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in the JSON line")

    data = json.loads(lines[-1], parse_constant=refuse)
    assert data["p50_ms"] is None and data["p99_ms"] is None
    assert any(line.split() == ["latency", "p50", "-"] for line in lines)
