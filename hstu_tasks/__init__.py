"""hstu_tasks: the HSTU generative-recommender ranking step as aiopipe tasks.

The adapter layer on top of aiopipe: torchrec, fbgemm and megatron-core may be
imported here, never in ``aiopipe`` itself.
"""

__all__: tuple[str, ...] = ()
