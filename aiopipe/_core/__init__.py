"""aiopipe's private core: the plumbing every layer above stands on.

Each module here does one job and imports only the standard library,
``aiopipe.errors`` and its siblings (``nvtx`` and ``uvloop`` only inside the
functions that use them, when installed); a test enforces it.  Nothing here knows
about tasks, schedules or torch.

* ``waker``   -- ``LoopWaker``: other threads hand calls to the event loop
* ``flags``   -- ``OneShotFlag``: a cross-thread completion flag (one per cross-lane edge)
* ``lanes``   -- lane threads and their pool (which task runs where: ``aiopipe.lanes``)
* ``tickets`` -- ``TicketLock``: one collective order on every rank
* ``loops``   -- event loops for ordinary code (``aiopipe.run``, the blocking API)
* ``steps``   -- ``AwaitClock``: a coroutine's time suspended at ``await``s (tracing)
* ``openmp``, ``malloc``, ``nvtx``, ``log`` -- platform shims and the loggers

Nothing is public: the supported names are re-exported by ``aiopipe`` and its
public submodules.
"""

__all__ = ()
