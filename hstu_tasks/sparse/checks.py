"""Arguments of the pipelines on a torchrec-sharded model, checked when a pipeline is
built: before a batch is taken, with messages that name the argument and what to pass."""

from __future__ import annotations

import torch

from aiopipe import ConfigurationError, ConfigurationTypeError

__all__ = ("check_flags", "pipeline_device")


def check_flags(**flags: object) -> None:
    """Refuse a flag that is not a bool (``None`` stands for "decide"): a string such
    as ``"no"`` would count as true."""
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise ConfigurationTypeError(f"{name} must be True or False, got {value!r}")


def pipeline_device(device: object) -> torch.device:
    """``device`` as a pipeline's, refused at construction if no step could run there
    (torch would refuse it only inside the first step, or with a message of its own)."""
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise ConfigurationTypeError(f"device must be a torch.device, a str such as 'cpu' "
                                     f"or 'cuda:0', or a CUDA index, got "
                                     f"{type(device).__name__}")  # fmt: skip
    try:
        chosen = torch.device(device)
    except RuntimeError as exc:
        raise ConfigurationError(f"device {device!r} is not a device torch knows: {exc}") from None
    if chosen.type == "meta":
        raise ConfigurationError("device 'meta' holds no data; pass the device the model's "
                                 "dense parameters are on")  # fmt: skip
    if chosen.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigurationError(f"device {device!r}, but torch sees no CUDA device here "
                                     f"(a CPU-only torch, or no GPU); pass 'cpu'")  # fmt: skip
        if chosen.index is not None and chosen.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise ConfigurationError(f"device {device!r}, but torch sees {count} CUDA "
                                     f"device(s) here")  # fmt: skip
    return chosen
