"""Whether other work shared the machine while an example ran: its steps/s then says
little (on a 2-core machine, beside other busy processes, every pipeline and the
plain loop ran 5-30x slower), and a newcomer comparing pipelines should know."""

from __future__ import annotations

import os

__all__ = ("busy_machine_note",)


def busy_machine_note() -> str | None:
    """A note for a script's speed line when the 1-minute load average is well above
    what the run itself explains (its lane and torch's threads fill every core:
    ``1.5 x cores + 1``); ``None`` otherwise, and where the load is not known."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average here (Windows)
        return None
    cores = os.cpu_count() or 1
    if load <= 1.5 * cores + 1:
        return None
    return (f"note: the machine was busy while this ran (load average {load:.1f} on {cores} "
            f"core{'s' * (cores != 1)}), so steps/s says little: time on an idle machine, "
            f"or with OMP_NUM_THREADS=1 on a shared one")
