"""Another benchmark, run on this tree and on an earlier revision, side by side.

Each round runs the benchmark once on each package -- this working tree and a copy
of revision ``--base`` (each side with its own benchmark script, so renamed APIs
do not matter) -- alternating which side goes first, so that drift in the
machine's speed hits both alike.  Every number in the benchmark's ``JSON`` line is
compared: median of the rounds per side, spread, and new / old.

    ./dev bench versus --base HEAD~3 engine_overhead --iterations 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _common import print_json, print_table, progress, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def checkout(revision: str, into: Path) -> Path:
    """The tree of ``revision`` unpacked into ``into`` (no git worktree to clean up)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    tree = into / "tree"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(tree, filter="data")
    return tree


def run_once(tree: Path, benchmark: str, args: list[str]) -> dict[str, float]:
    """One run of ``tree``'s copy of ``benchmark``, importing ``tree``'s package; the
    numbers of its ``JSON`` line, flattened to ``a/b/c`` keys."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / f"{benchmark}.py"), *args],
        cwd=tree, env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    lines = [line for line in out.splitlines() if line.startswith("JSON ")]
    if not lines:
        raise SystemExit(f"{benchmark} printed no JSON line:\n{out}")
    return dict(_numbers(json.loads(lines[-1][5:]), ""))


def _numbers(value: object, key: str) -> Iterator[tuple[str, float]]:
    if isinstance(value, bool) or key.startswith("args"):
        return
    if isinstance(value, (int, float)):
        yield key, float(value)
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _numbers(item, f"{key}/{name}" if key else str(name))
    elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value) and value:
        yield key, float(statistics.median(value))  # a benchmark's own repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="runs per side")
    parser.add_argument("benchmark", help="the benchmark's name, e.g. engine_overhead")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {"new": {}, "old": {}}
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = checkout(args.base, Path(scratch))
        trees = {"new": ROOT, "old": old_tree}
        for round_no in range(1, args.rounds + 1):
            order = ("new", "old") if round_no % 2 else ("old", "new")
            for side in order:
                for key, number in run_once(trees[side], args.benchmark, args.args).items():
                    samples[side].setdefault(key, []).append(number)
            progress(f"round {round_no}/{args.rounds} done ({' then '.join(order)})")
    rows, ratios = [], {}
    for key in sorted(set(samples["new"]) & set(samples["old"])):
        new, old = samples["new"][key], samples["old"][key]
        new_median, old_median = statistics.median(new), statistics.median(old)
        ratio = new_median / old_median if old_median else float("nan")
        ratios[key] = ratio
        rows.append([key, f"{new_median:.4g} {spread(new)}", f"{old_median:.4g} {spread(old)}",
                     f"{ratio:.3f}"])  # fmt: skip
    print_table(
        f"{args.benchmark}: this tree against {args.base}, {args.rounds} rounds each "
        f"(median, spread)", ["metric", "new", "old", "new / old"], rows,
    )  # fmt: skip
    print_json("versus", {"benchmark_run": args.benchmark, "base": args.base,
                          "new_over_old": ratios, "rounds": args.rounds})  # fmt: skip


if __name__ == "__main__":
    main()
