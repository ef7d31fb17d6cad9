"""What running the step on lane threads costs, pipeline by pipeline.

The HSTU demo step (or DLRM's) on one rank (or more) under each pipeline, every
pipeline in a worker process of its own, in short alternating chunks.

The rows: the plain loop, torchrec's ``TrainPipelineSparseDist``, aiopipe as the demo
runs it (async form on uvloop when installed, default lanes: on a CPU every task on
lane "compute"), the async form on asyncio's loop, the blocking form, the io/compute
lanes (``HSTU_IO_LANE_THREAD_MAP``), torchrec's rewrite of the model
for a pipelined input distribution (``pipelined_input_dist=True``: the default on
more ranks, not on one CPU rank), and every task inline on the calling thread
(``executor="sequential"``), and ``aiopipe-many`` / ``aiopipe-blocking-many``: a
whole chunk asked for in one ``progress_many`` call, the lanes chaining its steps.

Every pipeline runs in worker processes of its own, in short alternating chunks,
``--processes`` fresh sets of them (``benchmarks/_chunks.py`` says why); the per-round
ratio to torchrec's pipeline pairs neighbours in time, and the fastest chunk of each
row, the least disturbed, is printed beside its median.
``--tasks`` traces the aiopipe rows and prints each task's median time (the tracer
costs a little per task).  ``--model dlrm`` times torchrec's DLRM instead
(``examples/train_dlrm.py``'s model on ``SparseDistPipeline``, a 2-4 ms step).
``--ranks 2`` gives every pipeline a gloo group of two worker processes of its own
(each rank its own data); a chunk's time is the slower rank's.  With ``--model dlrm``
the configs ``aiopipe-S`` and ``torchrec-S`` for S in lite, base, fused and semi-sync
time the other members of torchrec's family (``schedule=``) beside torchrec's class for
each, which their ratio pairs with (``aiopipe-many-S``: a whole chunk a
``progress_many`` call; ``aiopipe-sequential-S``: every task inline, no lane;
semi-sync from the first step, ``start_batch=0``; torchrec's fused and semi-sync
classes through ``torchrec_classes_on_cpu`` on a CPU),
and ``aiopipe-ends-apart`` runs the sparse-dist pipeline with ``end_together=False``
(what the ranks' agreement on the end of the epoch costs: on by default with two
ranks).  Every row reports its workers' peak resident memory while timed (the largest
rank's, interpreter and model included: compare rows), and a second table rank 0's CPU
time a step by kind of thread (the loop, the lanes, the rest) and the lanes' wait for
a core.

    ./dev bench lane_cost [--model hstu|dlrm] [--ranks 1] [--chunk 20|80] [--rounds 15]
                          [--processes 3] [--configs ...] [--tasks]
    ./dev bench lane_cost --model dlrm --configs aiopipe-lite torchrec-lite aiopipe-base ...
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _chunks import (  # noqa: E402
    first_timed_step,
    paired,
    print_thread_cpu,
    repeat,
    time_in_chunks,
)
from _common import print_json, print_table, spread  # noqa: E402

CONFIGS = ("none", "torchrec", "aiopipe", "aiopipe-asyncio-loop", "aiopipe-blocking",
           "aiopipe-io-lane", "aiopipe-rewritten", "aiopipe-sequential", "aiopipe-many",
           "aiopipe-blocking-many")  # fmt: skip
#: torchrec's other train pipelines and their schedules (``--model dlrm`` only).
SCHEDULES = ("lite", "base", "fused", "semi-sync")
FAMILY = (*(f"{runner}-{schedule}" for schedule in SCHEDULES
            for runner in ("aiopipe", "aiopipe-many", "aiopipe-sequential", "torchrec")),
          "aiopipe-ends-apart")  # fmt: skip
#: The knobs of a family row: semi-sync from the first step (torchrec's default, 900,
#: would start it inside the timed chunks).
KNOBS: dict[str, dict[str, Any]] = {"semi-sync": {"start_batch": 0}}
WARM_UP = 20  # steps before the first timed chunk (bootstrap, caches, allocator)
#: What a worker keeps entered until it exits (a context left to the collector would
#: be closed by it).
_PATCHES = contextlib.ExitStack()


def _build(config: str, rank: int, *, model: str,
           trace: bool) -> tuple[Callable[[int], None], Callable[[], dict[str, float]]]:  # fmt: skip
    """The chunk worker's ``(run, report)``: ``report()`` gives each traced task's
    median ms over the timed steps."""
    run, tracer = _stepper(config, model, trace, rank)

    def report() -> dict[str, float]:
        if tracer is None:
            return {}
        spans = collections.defaultdict(list)
        first = first_timed_step()  # the untimed steps' spans are left out
        for span in tracer.spans:
            if span.iteration >= first:
                spans[span.task].append((span.end_ns - span.start_ns) / 1e6)
        return {name: statistics.median(ms) for name, ms in spans.items()}

    return run, report


def _stepper(config: str, model: str, trace: bool,
             rank: int) -> tuple[Callable[[int], None], Any]:  # fmt: skip
    """``(run(n), tracer)``: ``run(n)`` trains the next ``n`` batches with ``config``."""
    from hstu_tasks import (
        HSTU_IO_LANE_THREAD_MAP,
        DataConfig,
        HSTUPipelineFactory,
        ModelConfig,
        OptimizerConfig,
        SyntheticHSTUData,
        build_training,
        quiet_torchrec,
    )
    from hstu_tasks.parallel import plain_train_step
    from hstu_tasks.runners import torchrec_pipeline

    from aiopipe import Tracer

    quiet_torchrec()
    if model == "dlrm":
        return _dlrm_stepper(config, trace, rank)
    setup = build_training(ModelConfig(), DataConfig(), OptimizerConfig(), seed=0)
    # The demo's source: each batch is built when it is read.
    source: Iterator[Any] = iter(SyntheticHSTUData(DataConfig(), 10**6, seed=1, rank=rank))
    if config == "none":
        return repeat(lambda: plain_train_step(setup, next(source))), None
    if config == "torchrec":
        sparse_dist = torchrec_pipeline(setup)
        return repeat(lambda: sparse_dist.progress(source)), None
    tracer = Tracer() if trace else None
    options = _aiopipe_options(config, HSTU_IO_LANE_THREAD_MAP)
    pipe = HSTUPipelineFactory.create(
        "hstu_sparse_dist", model=setup.model, optimizer=setup.optimizer,
        device=setup.device, trace=tracer, **options,
    )  # fmt: skip
    return _aiopipe_run(config, pipe, source), tracer


def _aiopipe_options(config: str, io_thread_map: Any) -> dict[str, Any]:
    if config == "aiopipe-io-lane":
        return {"thread_map": io_thread_map}  # copies on "io"
    if config == "aiopipe-rewritten":  # torchrec's pipelined input dist, as on more ranks
        return {"pipelined_input_dist": True}
    if config.startswith("aiopipe-sequential"):
        return {"executor": "sequential"}
    if config == "aiopipe-ends-apart":
        return {"end_together": False}
    return {}


def _aiopipe_run(config: str, pipe: Any, source: Iterator[Any]) -> Callable[[int], None]:
    """``run(n)`` for an aiopipe row: the blocking form, or the async form on one loop."""
    from aiopipe._core.loops import LoopRunner
    if config == "aiopipe-blocking":
        blocking = pipe.blocking()
        return repeat(lambda: blocking.progress(source))
    if config == "aiopipe-blocking-many":
        blocking = pipe.blocking()
        return lambda n: _all_of(n, blocking.progress_many(source, n))
    # One loop for every chunk, as one `aiopipe.run` would be (uvloop when installed).
    runner = LoopRunner(prefer_uvloop=config != "aiopipe-asyncio-loop")

    async def chunk(n: int) -> None:
        if config.startswith("aiopipe-many"):
            _all_of(n, await pipe.progress_many(source, n))
            return
        for _ in range(n):
            await pipe.progress(source)

    return lambda n: runner.run(chunk, n)


def _all_of(n: int, results: list[Any]) -> None:
    if len(results) != n:
        raise RuntimeError(f"progress_many returned {len(results)} of {n} results")


def _schedule_of(config: str) -> str:
    """The schedule a row runs: ``aiopipe-many-lite`` and ``torchrec-lite`` run lite."""
    if config not in FAMILY[:-1]:
        return "sparse-dist"
    for runner in ("aiopipe-many-", "aiopipe-sequential-", "aiopipe-", "torchrec-"):
        if config.startswith(runner):
            return config.removeprefix(runner)
    raise ValueError(f"no schedule in {config!r}")


def _dlrm_stepper(config: str, trace: bool, rank: int) -> tuple[Callable[[int], None], Any]:
    """torchrec's DLRM (``examples/train_dlrm.py``'s model) on ``SparseDistPipeline``."""
    from aiopipe import Tracer
    from hstu_tasks import DLRMConfig, SparseDistPipeline, SyntheticDLRMData, build_dlrm_training
    from hstu_tasks.sparse._torchrec import torchrec_classes_on_cpu
    from hstu_tasks.sparse.dlrm_runs import CUDA_ONLY_CLASSES, TORCHREC_PIPELINES
    from hstu_tasks.sparse.schedules import train_schedule
    from hstu_tasks.sparse.tasks import SPARSE_DIST_THREAD_MAP

    config_ = DLRMConfig()
    setup = build_dlrm_training(config_, "sgd", seed=0)
    source: Iterator[Any] = iter(SyntheticDLRMData(config_, 10**6, seed=1, rank=rank))
    if config == "none":
        model, optimizer = setup.model, setup.optimizer

        def plain_step() -> None:
            optimizer.zero_grad()
            loss, _ = model(next(source).to(setup.device))
            loss.backward()
            optimizer.step()

        return repeat(plain_step), None
    schedule = _schedule_of(config)
    knobs = KNOBS.get(schedule, {})
    if config.startswith("torchrec"):
        pipeline = TORCHREC_PIPELINES[schedule]
        if issubclass(pipeline, CUDA_ONLY_CLASSES):  # this worker's process, for its life
            _PATCHES.enter_context(torchrec_classes_on_cpu())
        torchrec = pipeline(setup.model, setup.optimizer, setup.device, **knobs)
        return repeat(lambda: torchrec.progress(source)), None
    tracer = Tracer() if trace else None
    options = _aiopipe_options(config, SPARSE_DIST_THREAD_MAP)
    pipe = SparseDistPipeline(setup.model, setup.optimizer, setup.device,
                              schedule=train_schedule(schedule, knobs), trace=tracer,
                              **options)  # fmt: skip
    return _aiopipe_run(config, pipe, source), tracer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("hstu", "dlrm"), default="hstu",
                        help="the HSTU demo, or torchrec's DLRM on SparseDistPipeline")
    parser.add_argument("--ranks", type=int, default=1,
                        help="worker processes per pipeline, one gloo group each")
    parser.add_argument("--chunk", type=int, default=None,
                        help="steps per timed chunk (default: 20 HSTU, 80 DLRM steps)")
    parser.add_argument("--rounds", type=int, default=15, help="chunks per pipeline and process")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh processes per pipeline, one set after another")  # fmt: skip
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS + FAMILY)
    parser.add_argument("--tasks", action="store_true", help="trace the aiopipe rows")
    args = parser.parse_args()
    if args.chunk is None:  # chunks of about a quarter of a second either way
        args.chunk = 80 if args.model == "dlrm" else 20
    if args.model == "hstu" and set(args.configs) & set(FAMILY):
        parser.error(f"{', '.join(FAMILY)} need --model dlrm")
    if min(args.ranks, args.chunk, args.rounds, args.processes) < 1:
        parser.error("--ranks, --chunk, --rounds and --processes must be at least 1")
    chunks = time_in_chunks(
        functools.partial(_build, model=args.model, trace=args.tasks), args.configs,
        chunk=args.chunk, rounds=args.rounds, processes=args.processes, ranks=args.ranks,
        gloo=True, warm_up=WARM_UP,
    )  # fmt: skip
    ms, per_set = chunks.ms, chunks.reports
    tasks = {  # each task's median over the sets' medians
        config: {name: statistics.median(s[name] for s in sets if name in s)
                 for name in {n for s in sets for n in s}}
        for config, sets in per_set.items()
    }  # fmt: skip
    rows = []
    for config, values in ms.items():
        # torchrec's class for the row's schedule when it was timed, else the sparse-dist one
        partner = f"torchrec-{_schedule_of(config)}" if config in FAMILY else "torchrec"
        base = ms.get(partner, ms.get("torchrec"))
        ratio = (
            f"{paired(values, base):.3f}" if base else "--"
        )
        best = f"{min(values) / min(base):.3f}" if base else "--"
        rows.append([config, f"{statistics.median(values):.2f}", spread(values), ratio,
                     f"{min(values):.2f}", best,
                     f"{statistics.median(chunks.cores[config]):.2f}",
                     f"{max(chunks.peak_rss_mib[config]):.0f}"])  # fmt: skip
    print_table(
        f"{'HSTU demo' if args.model == 'hstu' else 'DLRM'} step, {args.ranks} rank(s) on gloo, "
        f"{args.processes} process sets, {args.rounds} alternating chunks of {args.chunk} "
        "steps per set",
        ["pipeline", "ms/step", "spread", "x torchrec (paired median)", "fastest chunk",
         "x torchrec's fastest", "cores busy (cpu/wall)", "peak RSS MiB"],
        rows,
    )
    print_thread_cpu(chunks)
    if args.tasks:
        names = sorted({n for t in tasks.values() for n in t}, key=lambda n: -max(
            t.get(n, 0.0) for t in tasks.values()))  # fmt: skip
        traced = [c for c, t in tasks.items() if t]
        print_table(
            "median ms per task (traced rows)",
            ["task", *traced],
            [[n, *(f"{tasks[c].get(n, 0.0):.3f}" for c in traced)] for n in names],
        )
    print_json("lane_cost", {"args": vars(args), "ms_per_step": ms, "cores": chunks.cores,
                             "task_ms": tasks, "peak_rss_mib": chunks.peak_rss_mib,
                             "cpu_us_per_step": chunks.thread_cpu_us})  # fmt: skip


if __name__ == "__main__":
    main()
