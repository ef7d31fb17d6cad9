"""``HSTUPipelineFactory``: named pipeline variants, like the legacy factory."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any, ClassVar

from aiopipe import ConfigurationError

from .pipeline import HSTUPipeline

__all__ = ("HSTUPipelineFactory", "UnknownPipelineError")

Builder = Callable[..., HSTUPipeline]


class UnknownPipelineError(ConfigurationError, KeyError):
    """``HSTUPipelineFactory.create`` was given a name no pipeline is registered under
    (a ``KeyError`` too, as a registry lookup)."""

    def __str__(self) -> str:  # a KeyError's would print the message in quotes
        return str(self.args[0])


class HSTUPipelineFactory:
    """``create("hstu_prefetch_sparse_dist", model=..., optimizer=..., device=...)``."""

    _registry: ClassVar[dict[str, Builder]] = {}

    @classmethod
    def register(cls, name: str, builder: Builder) -> None:
        if name in cls._registry:
            raise ValueError(f"an HSTU pipeline named {name!r} is already registered")
        cls._registry[name] = builder

    @classmethod
    def create(cls, name: str, **kwargs: Any) -> HSTUPipeline:
        try:
            builder = cls._registry[name]
        except KeyError:
            close = difflib.get_close_matches(str(name), cls.list(), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownPipelineError(
                f"unknown HSTU pipeline {name!r}{hint}; known: {', '.join(cls.list())}"
            ) from None
        return builder(**kwargs)

    @classmethod
    def list(cls) -> list[str]:
        return sorted(cls._registry)


HSTUPipelineFactory.register("hstu_sparse_dist", lambda **kw: HSTUPipeline(prefetch=False, **kw))
HSTUPipelineFactory.register(
    "hstu_prefetch_sparse_dist", lambda **kw: HSTUPipeline(prefetch=True, **kw)
)
