"""``HSTUPipelineFactory``: named pipeline variants, like the legacy factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from .pipeline import HSTUPipeline

__all__ = ("HSTUPipelineFactory",)

Builder = Callable[..., HSTUPipeline]


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
            raise KeyError(f"unknown HSTU pipeline {name!r}; known: {cls.list()}") from None
        return builder(**kwargs)

    @classmethod
    def list(cls) -> list[str]:
        return sorted(cls._registry)


HSTUPipelineFactory.register("hstu_sparse_dist", lambda **kw: HSTUPipeline(prefetch=False, **kw))
HSTUPipelineFactory.register(
    "hstu_prefetch_sparse_dist", lambda **kw: HSTUPipeline(prefetch=True, **kw)
)
