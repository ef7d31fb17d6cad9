"""Generate docs/api.md, the API reference, from aiopipe's docstrings.

    python docs/build_api.py            # rewrite docs/api.md
    python docs/build_api.py --check    # exit 1 if docs/api.md is stale or a public
                                        # name has no documentation

The reference covers the names in ``__all__`` of the modules listed in ``MODULES``;
a name already documented in an earlier module is listed, not repeated.  Classes get
their constructor signature, docstring and public methods and properties; functions
their signature and docstring; other values their ``repr`` and the ``#:`` comment
above their assignment (or a mention in their module's docstring).  Docstrings are
reStructuredText-ish; the few constructs used here (double backquotes, roles, simple
tables, ``::`` literal blocks) are turned into Markdown.  Only the standard library
and aiopipe itself are imported, and the output does not depend on the machine.
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"
MODULES = (
    "aiopipe",
    "aiopipe.executors",
    "aiopipe.presets",
    "aiopipe.trace",
    "aiopipe.timeline",
    "aiopipe.checkpoint",
    "aiopipe.dag",
    "aiopipe.autosched",
    "aiopipe.diagram",
    "aiopipe.cli",
)
WIDTH = 92  # signatures longer than this get one parameter per line

HEADER = """\
# API reference

Generated from the docstrings by `python docs/build_api.py`; edit the docstrings, not
this file (`tests/test_api_docs.py` fails when it is out of date). The concepts behind
these names are explained in [concepts.md](concepts.md).
"""


# -- docstrings to Markdown -----------------------------------------------------------------

_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_BORDER = re.compile(r"^\s*=+(\s+=+)+\s*$")


def _inline(text: str) -> str:
    # :class:`~aiopipe.trace.Tracer` shows as `Tracer`, :func:`aiopipe.run` in full
    def role(match: re.Match[str]) -> str:
        target = match.group(2)
        return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"

    text = _ROLE.sub(role, text)
    return text.replace("``", "`")


def markdown(doc: str) -> str:
    """A cleaned docstring as Markdown: tables and literal blocks fenced."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _BORDER.match(line):  # an RST simple table: top, header rule, bottom border
            block, borders = [], 0
            while i < len(lines) and borders < 3:
                borders += bool(_BORDER.match(lines[i]))
                block.append(lines[i])
                i += 1
            out += ["```text", *block, "```"]
            continue
        if line.rstrip().endswith("::"):
            text = line.rstrip()[:-1]
            if text.strip() != ":":
                out.append(_inline(text))
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith(" ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            indent = min((len(b) - len(b.lstrip()) for b in block if b.strip()), default=0)
            out += ["", "```text", *(b[indent:] for b in block), "```", ""]
            continue
        out.append(_inline(line))
        i += 1
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# -- signatures ---------------------------------------------------------------------------


def _annotation(value: Any) -> str:
    return value if isinstance(value, str) else inspect.formatannotation(value)


def _default(value: Any) -> str:
    text = repr(value)
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)  # no addresses: the output must be stable


def signature(
    name: str, obj: Callable[..., Any], drop_first: bool = False, width: int | None = WIDTH
) -> str | None:
    """``name(params) -> returns``; over ``width`` characters, one parameter a line."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts: list[str] = []
    star_done = False
    for index, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        stars = "*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else ""
        text = stars + p.name
        star_done = star_done or p.kind is p.VAR_POSITIONAL
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            equals = " = " if p.annotation is not p.empty else "="
            text += equals + _default(p.default)
        parts.append(text)
        following = params[index + 1] if index + 1 < len(params) else None
        last_positional_only = following is None or following.kind is not p.POSITIONAL_ONLY
        if p.kind is p.POSITIONAL_ONLY and last_positional_only:
            parts.append("/")
    returns = ""
    if sig.return_annotation is not sig.empty and _annotation(sig.return_annotation) != "None":
        returns = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){returns}"
    if width is None or len(one_line) <= width:
        return one_line
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


# -- documentation of values --------------------------------------------------------------


def _comment_docs(module_name: str) -> dict[str, str]:
    """``#:`` comments above top-level assignments, in the module and (for a package)
    its submodules: ``{name: comment}``."""
    module = importlib.import_module(module_name)
    file = Path(module.__file__ or "")
    files = sorted(file.parent.glob("*.py")) if file.name == "__init__.py" else [file]
    found: dict[str, str] = {}
    for path in files:
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            comment: list[str] = []
            row = node.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#:"):
                comment.insert(0, lines[row].strip()[2:].strip())
                row -= 1
            for name in names:
                if comment and name not in found:
                    found[name] = " ".join(comment)
    return found


def _own_doc(obj: Any) -> str | None:
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__")
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        doc = obj.__doc__
    else:
        return None
    return doc if isinstance(doc, str) and doc.strip() else None


def _value_doc(module_name: str, name: str, obj: Any, comments: dict[str, str]) -> str | None:
    if name in comments:
        return comments[name]
    home = importlib.import_module(getattr(obj, "__module__", None) or module_name)
    if isinstance(obj, enum.Enum):
        home = sys.modules[type(obj).__module__]
    for where in (home, sys.modules[module_name]):
        if where.__doc__ and re.search(rf"\b{re.escape(name)}\b", where.__doc__):
            return f"Described in the docstring of `{where.__name__}`."
    return None


# -- rendering ----------------------------------------------------------------------------


def _private(base: type) -> bool:
    """A base that is not part of the API: its name or a module on its path is private
    (a mixin holding part of a class's methods, as ``aiopipe._core.closing``'s)."""
    return base.__name__.startswith("_") or any(
        part.startswith("_") for part in base.__module__.split(".")
    )


def _own_vars(cls: type) -> dict[str, object]:
    """What ``cls`` defines, with what its private bases define (not overridden)."""
    found: dict[str, object] = {}
    for base in cls.__mro__:
        if base is not cls and (base is object or not _private(base)):
            break  # a public base documents its own (and its private bases') members
        for name, raw in vars(base).items():
            found.setdefault(name, raw)
    return found


def _members(cls: type) -> Iterator[tuple[str, str | None, str | None]]:
    """``(display signature, kind, docstring)`` of the public members defined in
    ``cls`` itself (or in a private base of it)."""
    for name, raw in _own_vars(cls).items():
        if name.startswith("_"):
            continue
        shown: str | None
        kind: str | None
        if isinstance(raw, property):
            returns = raw.fget.__annotations__.get("return") if raw.fget else None
            shown = f"{name}: {_annotation(returns)}" if returns else name
            yield shown, "property", raw.__doc__
        elif isinstance(raw, (staticmethod, classmethod)):
            function = raw.__func__
            kind = "staticmethod" if isinstance(raw, staticmethod) else "classmethod"
            shown = signature(name, function, isinstance(raw, classmethod), width=None)
            yield shown or name, kind, inspect.getdoc(function)
        elif not inspect.isfunction(raw) and inspect.isfunction(getattr(cls, name, None)):
            # a descriptor that resolves to a plain function (SchedulablePipeline.basic)
            function = getattr(cls, name)
            shown = signature(name, function, False, width=None)
            yield shown or name, "staticmethod", inspect.getdoc(function)
        elif inspect.isfunction(raw):
            is_async = inspect.iscoroutinefunction(raw) or inspect.isasyncgenfunction(raw)
            kind = "async" if is_async else None
            shown = signature(name, raw, drop_first=True, width=None)
            yield shown or name, kind, inspect.getdoc(getattr(cls, name))
        elif type(raw).__name__ == "cached_property":
            yield name, "property", raw.__doc__


def _render_class(qualname: str, cls: type) -> list[str]:
    out = [f"### class `{qualname}`", ""]
    bases = [b.__name__ for b in cls.__bases__ if b is not object and not _private(b)]
    if bases:
        out += [f"Bases: {', '.join(f'`{b}`' for b in bases)}", ""]
    if issubclass(cls, enum.Enum):
        out += [f"Members: {', '.join(f'`{m.name}`' for m in cls)}", ""]
    elif not (issubclass(cls, BaseException) and "__init__" not in vars(cls)):
        sig = signature(qualname, cls)
        if sig and not sig.endswith("(*args, **kwargs)"):
            out += ["```python", sig, "```", ""]
    doc = _own_doc(cls)
    if doc:
        out += [markdown(doc), ""]
    for shown, kind, member_doc in _members(cls):
        label = f"*{kind}* " if kind else ""
        out.append(f"- {label}`{shown}`")
        if member_doc:  # a documented member is its own paragraph under the bullet
            body = markdown(member_doc)
            out += ["", *(f"  {line}" if line else "" for line in body.splitlines()), ""]
    return [*out, ""]


def _render_function(qualname: str, fn: Callable[..., Any]) -> list[str]:
    prefix = "async " if inspect.iscoroutinefunction(fn) else ""
    shown = prefix + (signature(qualname, fn) or qualname)
    out = [f"### `{qualname}()`", "", "```python", shown, "```", ""]
    doc = _own_doc(fn)
    if doc:
        out += [markdown(doc), ""]
    return out


def _render_value(qualname: str, obj: Any, doc: str | None) -> list[str]:
    shown = _default(obj)
    out = [f"### `{qualname}`", ""]
    if len(shown) < WIDTH:  # long values (big tuples, objects) say nothing in one line
        out += [f"`{qualname.rsplit('.', 1)[-1]} = {shown}`", ""]
    if doc:
        out += [markdown(doc), ""]
    return out


def build() -> tuple[str, list[str]]:
    """The Markdown reference and the public names that have no documentation."""
    out = [HEADER, "Modules: " + ", ".join(f"[`{m}`](#{m.replace('.', '')})" for m in MODULES), ""]
    missing: list[str] = []
    seen: dict[int, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        comments = _comment_docs(module_name)
        out += [f"## `{module_name}`", ""]
        if module.__doc__:
            out += [markdown(module.__doc__), ""]
        again = []
        for name in module.__all__:
            obj = getattr(module, name)
            qualname = f"{module_name}.{name}" if module_name != "aiopipe" else name
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and id(obj) in seen:
                again.append(f"`{name}` ({seen[id(obj)]})")
                continue
            if inspect.isclass(obj):
                seen[id(obj)] = module_name
                if _own_doc(obj) is None:
                    missing.append(f"{module_name}.{name}")
                out += _render_class(qualname, obj)
            elif inspect.isfunction(obj):
                seen[id(obj)] = module_name
                if _own_doc(obj) is None:
                    missing.append(f"{module_name}.{name}")
                out += _render_function(qualname, obj)
            else:
                doc = _value_doc(module_name, name, obj, comments)
                if doc is None:
                    missing.append(f"{module_name}.{name}")
                out += _render_value(qualname, obj, doc)
        if again:
            out += ["Also exported here, documented above: " + ", ".join(again) + ".", ""]
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n", missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; change nothing")
    args = parser.parse_args()
    text, missing = build()
    for name in missing:
        print(f"undocumented public name: {name}", file=sys.stderr)
    if args.check:
        stale = not OUTPUT.exists() or OUTPUT.read_text() != text
        if stale:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python docs/build_api.py",
                  file=sys.stderr)  # fmt: skip
        return 1 if stale or missing else 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
