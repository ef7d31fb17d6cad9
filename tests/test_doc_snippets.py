"""Every fenced ``python`` snippet of README.md and docs/*.md runs.

The rules, for whoever writes a snippet:

* A page's snippets run in order, in one namespace per page: a snippet may use what
  an earlier one on the same page defined, never what another page defined.
* The namespace starts with the stand-ins of :func:`stand_ins` (a tiny model,
  optimizer, loader, tasks, schedule, ... -- the names the docs use without defining
  them) and aiopipe's top-level public names (``Pipeline``, ``Task``, ...).  Anything
  else a snippet uses it must import or define itself.  Add a stand-in here when a
  new snippet needs one; keep them small and fast.
* Top-level ``await`` / ``async with`` / ``async for`` is allowed: such a snippet runs
  on the page's event loop (one per page, so what one snippet starts the next can
  await).  Other snippets run outside any event loop, as in a script.
* A page whose snippets use the HSTU stand-ins of :func:`hstu_stand_ins`
  (``sharded_model``, ``dense_optimizer``, ``hstu_loader``) or call
  ``init_distributed`` runs inside a one-process gloo group, as rank 0 of a job
  started by torchrun would.
* A snippet that cannot run here (it needs a GPU, several ranks or the network) is marked
  by an HTML comment on the line just before its fence, with the reason::

      <!-- snippet: skip (needs a GPU: CUDA streams and events) -->

  Skips are counted (:data:`MAX_SKIPPED`): keep them rare.
* Files a snippet writes land in a temporary directory.  docs/api.md is left out: it
  is generated, and its ``python`` blocks are signatures, not code.

A failure names the page, the snippet's number on the page and the failing line of
the page (the traceback points into the Markdown file itself).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import gc
import inspect
import re
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import aiopipe
from aiopipe import BlockingPipeline, PipelineError, SchedulablePipeline, Schedule, Task, TaskContext

ROOT = Path(__file__).resolve().parents[1]
GENERATED = {"docs/api.md"}
#: How many snippets may be skipped in all; raise it only for a GPU, several ranks or
#: the network.
MAX_SKIPPED = 0

_FENCE = re.compile(r"^(\s*)```python\s*$")
_SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*$")
_MARKER = re.compile(r"^\s*<!--\s*snippet:")


# -- the stand-ins ------------------------------------------------------------------------


def stand_ins() -> dict[str, Any]:
    """A fresh namespace for one page: the objects the docs use without defining them."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = [torch.randn(8, 4) for _ in range(24)]  # an iterable of batches, like a DataLoader

    def featurize(batch: torch.Tensor) -> torch.Tensor:
        return batch * 2

    def loss_fn(output: torch.Tensor, batch: Any = None) -> torch.Tensor:
        # the docs call it as loss_fn(output) and as loss_fn(output, batch)
        return output.pow(2).mean()

    def batches() -> Iterator[torch.Tensor]:
        yield from loader

    def prepare(ctx: TaskContext) -> None:
        ctx.slots.set("features", featurize(ctx.slots["batch_cpu"]))

    def train(ctx: TaskContext) -> None:
        with torch.no_grad():
            ctx.slots.set("step_result", loss_fn(model(ctx.slots["features"])))

    # the tasks of README's example, with a step that leaves the model alone
    tasks = [
        Task.from_fn("prepare", prepare, lookahead=1, stream="io", writes=("features",)),
        Task.from_fn("train", train, reads=("features",), writes=("step_result",)),
    ]

    def passing(read: str, write: str) -> Callable[[TaskContext], None]:
        def body(ctx: TaskContext) -> None:
            ctx.slots.set(write, ctx.slots[read])

        return body

    # a training step's shape, bodies that pass the batch along (any batch will do)
    schedule = Schedule.of([
        Task.from_fn("h2d", passing("batch_cpu", "batch_gpu"), lookahead=1, stream="memcpy",
                     writes=("batch_gpu",)),
        Task.from_fn("forward", passing("batch_gpu", "output"), reads=("batch_gpu",),
                     writes=("output",)),
        Task.from_fn("backward", passing("output", "grads"), reads=("output",), writes=("grads",)),
        Task.from_fn("optimizer_step", passing("grads", "step_result"), reads=("grads",),
                     writes=("step_result",)),
    ])  # fmt: skip
    my_lanes = {"h2d": "io", "forward": "compute", "backward": "compute",
                "optimizer_step": "compute"}  # fmt: skip

    async def produce(send: Any) -> None:  # anyio.md: feeds a memory object stream
        async with send:
            for batch in loader:
                await send.send(batch)

    def fn(ctx: TaskContext) -> None:  # concepts.md: any task body
        ctx.slots.set("dist_request", ctx.slots["batch_gpu"])

    # dag.md: a table normalised into a row, accumulated into a total
    table = torch.rand(3, 4)

    def normalise(table: torch.Tensor, row: torch.Tensor) -> None:
        row.copy_(table.sum(0) / table.sum())

    def accumulate(row: torch.Tensor, total: torch.Tensor, alpha: float) -> float:
        total.add_(row, alpha=alpha)
        return float(total.sum())

    names: dict[str, Any] = {name: getattr(aiopipe, name) for name in aiopipe.__all__}
    names.update(
        __name__="__main__", aiopipe=aiopipe, asyncio=asyncio, torch=torch,
        device=torch.device("cpu"), model=model, opt=opt, loader=loader, featurize=featurize, loss_fn=loss_fn,
        batches=batches, tasks=tasks, schedule=schedule, my_lanes=my_lanes,
        pipe=aiopipe.Pipeline(tasks, thread_map={"prepare": "io", "train": "compute"}),
        Batch=torch.Tensor, produce=produce, other_source=iter(loader), fn=fn,
        table=table, row=torch.empty(4), total=torch.zeros(4), normalise=normalise,
        accumulate=accumulate,
        loss=torch.tensor(0.25),  # executors.md: a loss to copy to the host
        event=None,  # executors.md: a CUDA event; on CPU there is none (counts as done)
    )  # fmt: skip
    return names


#: Names of snippets that need a process group (see the module docstring).
_NEEDS_GROUP = re.compile(r"\b(sharded_model|dense_optimizer|hstu_loader|init_distributed)\b")


def hstu_stand_ins() -> dict[str, Any]:
    """The HSTU model with its tables sharded by torchrec, its dense optimizer and a
    few batches of synthetic data; call inside the page's process group."""
    from one_rank import TINY_DATA, tiny_training

    from hstu_tasks import SyntheticHSTUData

    training = tiny_training()
    return {"sharded_model": training.model, "dense_optimizer": training.optimizer,
            "device": training.device,
            "hstu_loader": SyntheticHSTUData(TINY_DATA, 4, seed=1, rank=0)}  # fmt: skip


# -- finding snippets -----------------------------------------------------------------------


@dataclass(frozen=True)
class Snippet:
    page: str  # relative to the repository root
    index: int  # 1-based, counting every python snippet of the page
    line: int  # of the first code line
    code: str
    skip: str | None  # the reason, when marked skip


def snippets_of(page: str, text: str) -> list[Snippet]:
    lines = text.splitlines()
    for row, line in enumerate(lines):
        if _MARKER.match(line) and not (row + 1 < len(lines) and _FENCE.match(lines[row + 1])):
            raise ValueError(f"{page}:{row + 1}: a snippet marker must sit on the line just "
                             f"before a ```python fence")  # fmt: skip
    found: list[Snippet] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent = len(fence.group(1))
        start = i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: the ```python fence is never closed")
        marker = lines[i - 1] if i > 0 else ""
        skip = _SKIP.match(marker)
        if skip is None and _MARKER.match(marker):
            raise ValueError(f"{page}:{i}: write the marker as <!-- snippet: skip (reason) -->")
        if skip is not None and not skip.group("reason").strip():
            raise ValueError(f"{page}:{i}: a skipped snippet must say why")
        code = "\n".join(line[indent:] for line in lines[start:end])
        reason = skip.group("reason").strip() if skip else None
        found.append(Snippet(page, len(found) + 1, start + 1, code, reason))
        i = end + 1
    return found


def pages() -> list[str]:
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return ["README.md", *(p for p in docs if p not in GENERATED)]


def all_snippets() -> dict[str, list[Snippet]]:
    found = {page: snippets_of(page, (ROOT / page).read_text()) for page in pages()}
    return {page: snippets for page, snippets in found.items() if snippets}


# -- running them ---------------------------------------------------------------------------


class SnippetFailed(AssertionError):
    """A snippet raised; the message says where in the page."""


def run_snippet(snippet: Snippet, namespace: dict[str, Any], runner: asyncio.Runner) -> None:
    filename = str(ROOT / snippet.page)  # tracebacks show the page's own lines
    source = "\n" * (snippet.line - 1) + snippet.code
    try:
        code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(code, namespace)  # noqa: S307 -- the repository's own docs
        if inspect.iscoroutine(result):  # top-level await: run it on the page's loop
            runner.run(result)
    except Exception as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == filename]
        line = frames[-1].lineno if frames else getattr(exc, "lineno", None) or snippet.line
        raise SnippetFailed(  # the traceback of the cause follows in the report
            f"{snippet.page}, snippet {snippet.index} (first line {snippet.line}), failed at "
            f"line {line}: {type(exc).__name__}: {exc}"
        ) from exc


def close_pipelines(namespace: dict[str, Any], threads_before: set[threading.Thread]) -> None:
    """Shut down the pipelines a page left open, and wait for their lane threads."""
    hstu = sys.modules.get("hstu_tasks")  # imported only by pages that use it
    closable = (SchedulablePipeline, BlockingPipeline, *([hstu.HSTUPipeline] if hstu else []))
    for value in list(namespace.values()):
        if isinstance(value, closable):
            with contextlib.suppress(PipelineError):  # a failed snippet's error comes first
                value.shutdown()
    namespace.clear()
    gc.collect()  # pipelines dropped without shutdown() stop their lanes when collected
    for thread in set(threading.enumerate()) - threads_before:
        if thread.name.startswith("aiopipe-"):
            thread.join(timeout=10)


def run_page(snippets: list[Snippet]) -> None:
    threads_before = set(threading.enumerate())
    namespace = stand_ins()
    to_run = [snippet for snippet in snippets if snippet.skip is None]
    with contextlib.ExitStack() as group:
        if any(_NEEDS_GROUP.search(snippet.code) for snippet in to_run):
            from one_rank import one_rank_group

            group.enter_context(one_rank_group())
            namespace.update(hstu_stand_ins())
        try:
            with asyncio.Runner() as runner:
                for snippet in to_run:
                    run_snippet(snippet, namespace, runner)
        finally:
            close_pipelines(namespace, threads_before)  # inside the group: they may use it


SNIPPETS = all_snippets()


@pytest.mark.parametrize("page", sorted(SNIPPETS))
def test_the_snippets_of_a_page_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_page(SNIPPETS[page])


def test_skipped_snippets_are_few_and_say_why() -> None:
    skipped = [s for snippets in SNIPPETS.values() for s in snippets if s.skip is not None]
    listing = "\n".join(f"  {s.page} snippet {s.index} (line {s.line}): {s.skip}" for s in skipped)
    assert len(skipped) <= MAX_SKIPPED, f"{len(skipped)} snippets are skipped:\n{listing}"
    assert all(s.skip for s in skipped)


# -- the mechanism itself ---------------------------------------------------------------------


PAGE = """\
# Title

```python
x = 1
```

<!-- snippet: skip (needs torchrun) -->
```python
import torch.distributed
```

Text.

  ```python
  y = await double(x)
  ```
"""


def test_snippets_are_found_with_their_lines_and_skips() -> None:
    found = snippets_of("docs/page.md", PAGE)
    assert [(s.index, s.line, s.code, s.skip) for s in found] == [
        (1, 4, "x = 1", None),
        (2, 9, "import torch.distributed", "needs torchrun"),
        (3, 15, "y = await double(x)", None),
    ]


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("```python\nx = 1\n", "never closed"),
        ("<!-- snippet: skip () -->\n```python\nx = 1\n```\n", "must say why"),
        ("<!-- snippet: skipped -->\n```python\nx = 1\n```\n", "write the marker as"),
        ("<!-- snippet: skip (GPU) -->\n\n```python\nx = 1\n```\n", "line just before"),
    ],
)
def test_malformed_pages_are_reported(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        snippets_of("docs/page.md", text)


def test_a_page_shares_one_namespace_and_one_loop() -> None:
    async def double(value: int) -> int:
        return 2 * value

    namespace: dict[str, Any] = {"double": double}
    loops: list[asyncio.AbstractEventLoop] = []

    async def loop_now() -> None:
        loops.append(asyncio.get_running_loop())

    namespace["loop_now"] = loop_now
    with asyncio.Runner() as runner:
        for snippet in snippets_of("docs/page.md", PAGE):
            if snippet.skip is None:
                run_snippet(snippet, namespace, runner)
        run_snippet(Snippet("docs/page.md", 4, 1, "await loop_now()\nawait loop_now()", None),
                    namespace, runner)  # fmt: skip
    assert namespace["y"] == 2
    assert len(set(loops)) == 1


def test_a_failure_names_the_page_the_snippet_and_the_line() -> None:
    page = "docs/page.md"
    snippet = snippets_of(page, "Intro.\n\n```python\nx = 1\ny = pool\n```\n")[0]
    with asyncio.Runner() as runner, pytest.raises(SnippetFailed) as caught:
        run_snippet(snippet, {}, runner)
    first = str(caught.value).splitlines()[0]
    assert first == (
        "docs/page.md, snippet 1 (first line 4), failed at line 5: "
        "NameError: name 'pool' is not defined"
    )


def test_a_syntax_error_names_its_line() -> None:
    snippet = snippets_of("docs/page.md", "```python\nx = 1\nx = = 2\n```\n")[0]
    with asyncio.Runner() as runner, pytest.raises(SnippetFailed, match="failed at line 3: SyntaxError"):
        run_snippet(snippet, {}, runner)
