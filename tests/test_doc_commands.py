"""Every shell command in README.md and docs/*.md runs as written after the README's
set-up (``./dev demo``, ``./dev test``, ``. .venv/bin/activate``).

Which commands: every line of a fenced block marked ```bash or ```sh in README.md or
docs/*.md, with lines ending in ``\\`` joined to the next and ``# comments`` dropped.
Output, synopses and diagrams go in ```text blocks; an unmarked block that starts
with a command fails :func:`test_command_blocks_are_marked`.

What is done with each: the first of ``RULES`` whose pattern matches the command
decides -- run it as written, run it changed in a way the rule names (fewer steps,
``--help`` for a long-running program), or leave it out for the reason given.  A
command that no rule matches fails the test: add a rule when you document a new
kind of command.

How: the selected commands run two at a time in the background from the first
test on (``commands_started``), each test waiting for its own; each command runs in
its own scratch folder that links to the repository's
``dev``, ``examples/`` and ``benchmarks/``, with the project's environment activated
(its ``bin/`` first on ``PATH``), and must exit 0.  Every file it writes there must
be one that git ignores in the repository root (or a tracked file it regenerates),
so running the documented commands leaves a clean checkout.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCE = re.compile(r"^```(bash|sh)\n(.*?)^```", re.S | re.M)
ANY_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
PROGRAMS = ("./dev", "aiopipe", "python", "torchrun", "pip", "curl")
DEMO_STEPS = "2"


@dataclass(frozen=True)
class DocCommand:
    source: str  # file:line
    text: str


def doc_commands() -> list[DocCommand]:
    commands, seen = [], set()
    for doc in DOCS:
        text = doc.read_text()
        for block in SHELL_FENCE.finditer(text):
            line_no = text.count("\n", 0, block.start(2))
            pending, start = "", 0
            for line in block.group(2).splitlines():
                line_no += 1
                start = start or line_no
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                    continue
                command = " ".join(strip_comment(pending + line).split())
                if command and command not in seen:  # the same line twice runs once
                    seen.add(command)
                    commands.append(DocCommand(f"{doc.name}:{start}", command))
                pending, start = "", 0
    return commands


def strip_comment(line: str) -> str:
    """The line without its ``# comment`` (a ``#`` that starts a word, outside quotes)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


# -- rules: the first match decides -------------------------------------------------------

Action = Callable[[str], str]


def as_written(command: str) -> str:
    return command


def few_steps(command: str) -> str:
    """The training demo with DEMO_STEPS steps (its long runs are the same code)."""
    if re.search(r"--steps\s+\d+", command):
        return re.sub(r"--steps\s+\d+", f"--steps {DEMO_STEPS}", command)
    return f"{command} --steps {DEMO_STEPS}"


def one_process(command: str) -> str:
    """A torchrun launch of a training example: ``torchrun`` must be on PATH, and the
    script with the same arguments must run in one process (one step: every rank
    runs the same code)."""
    found = re.search(r"examples/train_\w+\.py", command)
    assert found is not None
    script = re.sub(r"--steps\s+\d+", "", command[found.start():])
    if "./dev python" in command:
        return f"./dev python {script} --steps 1"
    return f"command -v torchrun && python {script} --steps 1"


def with_help(command: str) -> str:
    """A long-running program (a server, a benchmark): it exists and its options,
    as written, parse (``--help`` after them exits before it runs)."""
    return f"{command} --help"


def graphviz_or_dot(command: str) -> str:
    """Pictures need Graphviz's ``dot``; without it, draw the same graph as DOT."""
    if shutil.which("dot"):
        return command
    return re.sub(r"(-o\s+\S+)\.(svg|png|pdf)\b", r"\1.dot", command)


SKIP = None
RULES: list[tuple[str, Action | None, str]] = [
    (r"^\. \.venv/bin/activate$", SKIP, "the activation every command here runs in"),
    (r"^pip install", SKIP, "installs from the network"),
    (r"^curl ", SKIP, "talks to the server started by the line above"),
    (r"^\./dev test\b", SKIP, "the test suite itself"),
    (r"^\./dev gpu-prepare\b", SKIP, "downloads wheels (tests/test_gpu_suite.py runs it)"),
    (r"^\./dev gpu-suite\b", SKIP, "the GPU suite (tests/test_gpu_suite.py rehearses it)"),
    (r"^python -c .*merge_traces", SKIP, "merges the traces of the torchrun line above"),
    (r"torchrun .*examples/train_dlrm\.py .*--uneven", SKIP,
     "two ranks by design (tests/test_examples.py runs it on two)"),
    (r"(torchrun|torch\.distributed\.run) .*examples/train_(hstu|dlrm)\.py", one_process, ""),
    (r"^(\./dev demo|(\./dev )?python examples/train_(hstu|dlrm)\.py)\b", few_steps, ""),
    (r"^(\./dev bench \w+|(\./dev )?python benchmarks/\w+\.py)", with_help, ""),
    (r"^(\./dev )?python examples/serve_(hstu|load)\.py", with_help, ""),
    (r"^(\./dev )?python examples/(quickstart|dag_in_task|amp|async_fetch|online_fetch)\.py", as_written, ""),
    (r"^(aiopipe|(\./dev )?python -m aiopipe) graph ", graphviz_or_dot, ""),
    (r"^(aiopipe|(\./dev )?python -m aiopipe) (validate|trace|plan) ", as_written, ""),
]


def without_env(command: str) -> str:
    """The command without its leading ``VAR=value`` assignments."""
    return re.sub(r"^(\w+=\S*\s+)+", "", command)


def rule_for(command: str) -> tuple[Action | None, str]:
    for pattern, action, reason in RULES:
        if re.search(pattern, without_env(command)):
            return action, reason
    raise LookupError(f"no rule in {__name__}.RULES for {command!r}: add one")


# -- the environment ----------------------------------------------------------------------


def venv_ready() -> str | None:
    """Why ``./dev`` would install first here (None when the environment is current)."""
    if sys.prefix == sys.base_prefix:
        return "the tests do not run in a virtual environment"
    inputs = sorted((ROOT / "requirements").glob("*.txt")) + [ROOT / "pyproject.toml"]
    want = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()[:16]
    for stamp in ("runtime", "dev"):
        path = Path(sys.prefix) / f".aiopipe-{stamp}"
        if not path.is_file() or path.read_text().strip() != want:
            return f"{path} is not current: ./dev would install first (run ./dev test)"
    return None


def activated_env() -> dict[str, str]:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    env["VIRTUAL_ENV"] = sys.prefix
    env["AIOPIPE_VENV"] = sys.prefix  # ./dev uses the same environment
    env.pop("PYTHONPATH", None)
    return env


def scratch_folder(path: Path) -> Path:
    for name in ("dev", "examples", "benchmarks"):
        (path / name).symlink_to(ROOT / name)
    (path / "docs" / "img").mkdir(parents=True)  # outputs under docs/ stay here
    return path


def written_files(folder: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):  # does not follow the links
        for name in filenames:
            found.append(str((Path(dirpath) / name).relative_to(folder)))
    return sorted(found)


def not_ignored(paths: list[str]) -> list[str]:
    """The paths git would neither ignore nor find tracked in the repository root."""
    if not paths:
        return []
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT,
                             input="\n".join(paths), capture_output=True, text=True)  # fmt: skip
    tracked = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True,
                             text=True)  # fmt: skip
    known = set(ignored.stdout.split()) | set(tracked.stdout.split())
    return [p for p in paths if p not in known]


COMMANDS = doc_commands()


def test_the_docs_hold_commands_of_every_kind() -> None:
    texts = [c.text for c in COMMANDS]
    for start in ("./dev demo", "./dev bench", "aiopipe validate", "aiopipe graph", "torchrun",
                  "python examples/"):  # fmt: skip
        assert any(t.startswith(start) for t in texts), f"no documented command starts {start!r}"
    assert all(not t.startswith("#") and "\\" not in t.split()[-1] for t in texts)


def test_command_blocks_are_marked() -> None:
    unmarked = []
    for doc in DOCS:
        for block in ANY_FENCE.finditer(doc.read_text()):
            first = block.group(2).lstrip().split(" ", 1)[0]
            if not block.group(1) and first in PROGRAMS:
                unmarked.append(f"{doc.name}: {block.group(2).splitlines()[0]}")
    assert not unmarked, f"mark these blocks ```bash (or ```text for output): {unmarked}"


def test_every_rule_is_used() -> None:
    used = {pattern for pattern, _, _ in RULES
            if any(re.search(pattern, without_env(c.text)) for c in COMMANDS)}
    assert used == {pattern for pattern, _, _ in RULES}  # a stale rule hides nothing


def test_a_command_without_a_rule_is_an_error() -> None:
    with pytest.raises(LookupError, match="add one"):
        rule_for("make install")


def test_benchmarks_named_in_the_docs_exist() -> None:
    listing = subprocess.run([str(ROOT / "dev"), "bench"], capture_output=True, text=True,
                             env=activated_env(), timeout=60)  # fmt: skip
    assert listing.returncode == 0, listing.stderr
    listed = {line.split()[0] for line in listing.stdout.splitlines()[1:]}
    named = {name for doc in DOCS  # a benchmark name, not a placeholder such as NAME
             for name in re.findall(r"\./dev bench ([a-z]\w*)", doc.read_text())}
    assert named and named <= listed, f"documented but missing: {sorted(named - listed)}"


def why_not_run(command: DocCommand) -> str | None:
    """Why ``command`` is skipped here, if it is."""
    action, reason = rule_for(command.text)
    if action is None:
        return f"not run: {reason}"
    if command.text.startswith("./dev") or " ./dev " in command.text:
        return venv_ready()
    return None


@dataclass(frozen=True)
class Ran:
    to_run: str
    folder: Path
    done: subprocess.CompletedProcess[str]


def run_in_scratch(command: DocCommand, folder: Path) -> Ran:
    action, _ = rule_for(command.text)
    assert action is not None
    to_run = action(command.text)
    done = subprocess.run(["bash", "-c", to_run], cwd=scratch_folder(folder),
                          env=activated_env(), capture_output=True, text=True,
                          timeout=280)  # fmt: skip
    return Ran(to_run, folder, done)


@pytest.fixture(scope="module")
def commands_started(request: pytest.FixtureRequest,
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:  # fmt: skip
    """Every selected command that runs here, started two at a time in the background
    when the first of them is tested (each is a process of its own, mostly importing
    torch and torchrec: on two cores that halves the file's time); by the command's
    text, its result to come.  Each test still waits for and judges its own."""
    selected = [item.callspec.params["command"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_documented_command_runs"
                and item.module is sys.modules[__name__]]  # fmt: skip
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    started = {command.text: pool.submit(run_in_scratch, command,
                                         tmp_path_factory.mktemp("command"))
               for command in selected if why_not_run(command) is None}  # fmt: skip
    yield started
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.timeout(600)  # waits for its command, which may queue behind the others
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.source} {c.text[:60]}")
def test_documented_command_runs(command: DocCommand, commands_started: dict[str, Any]) -> None:
    why = why_not_run(command)
    if why is not None:
        pytest.skip(why)
    ran: Ran = commands_started[command.text].result()
    to_run, folder, done = ran.to_run, ran.folder, ran.done
    assert done.returncode == 0, (
        f"{command.source}: `{to_run}` exited {done.returncode}\n"
        f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    stray = not_ignored(written_files(folder))
    assert not stray, f"{command.source}: `{to_run}` wrote files git does not ignore: {stray}"
