"""Check that commands load and take their options, without running them.

Each command (``SCRIPT.py ARGS`` or ``-m MODULE ARGS``, given as a JSON list of
argument lists) runs in this one process until argparse has parsed its options --
after the program imported everything it imports at the top -- and is stopped there,
before any work.  An option it does not know, or a value it refuses, fails the check
with argparse's own message.  One process for all of them, so torch and torchrec load
once.  Prints one ``JSON`` line: ``[[ok, what went wrong], ...]`` in the commands' order.

    python scripts/gpu_argcheck.py '[["benchmarks/presets.py", "--device", "cuda"]]'
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys
import traceback
from typing import Any


class Parsed(BaseException):  # not an Exception: no handler of the program takes it
    """The program's options parsed: it is stopped before it does any work."""


def parse_and_stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
    PARSE_ARGS(self, *args, **kwargs)  # exits with argparse's message when they are wrong
    raise Parsed


PARSE_ARGS = argparse.ArgumentParser.parse_args


def check(argv: list[str]) -> tuple[bool, str]:
    module = argv[1] if argv[0] == "-m" else None
    sys.argv = [module or argv[0], *argv[2 if module else 1:]]
    errors = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(argv[0], run_name="__main__")
    except Parsed:
        return True, ""
    except SystemExit as exc:
        complaint = errors.getvalue().strip().splitlines()
        return False, complaint[-1] if complaint else f"it exited ({exc.code}) before parsing"
    except BaseException:  # noqa: BLE001 -- whatever stops it loading is the finding
        return False, traceback.format_exc().strip().splitlines()[-1]
    return False, "it ran to the end without parsing options (no argparse)"


def main() -> None:
    commands = json.loads(sys.argv[1])
    argparse.ArgumentParser.parse_args = parse_and_stop  # type: ignore[method-assign]
    print("JSON " + json.dumps([check(argv) for argv in commands]), flush=True)


if __name__ == "__main__":
    main()
