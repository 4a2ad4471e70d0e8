"""Parameters parked in host memory between the passes that use them (``actor.ref_param_offload``: the KL reference,
whose weights are needed only in its log-prob pass).

    parked = ParkedParams(reference.model, device=actor_device())   # parks at once
    with parked.on_device():                                         # back for the pass, parked again after it
        lp = reference.compute_log_probs(batch, T)

The rules: each parameter's ``.data`` is replaced (a new tensor, never a view of the old one), so the Parameter
objects every module and hook holds stay the same and the old storage is freed as soon as nothing else holds it --
true for a model without DDP buffers (the frozen reference), not for a DDP-wrapped actor, whose parameters are
views of its buffers (refused). The parameters are read-only (a parameter that requires grad is refused): the
host copy made at the first park is kept, so parking again only drops the device copy (one host-to-device copy
per pass, none back). Decision and numbers: docs/memory.md.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Sequence

import torch

__all__ = ["ParkedParams"]


class ParkedParams:
    """The parameters of ``chunks`` (each once), parked in host memory until ``on_device``."""

    def __init__(self, chunks: Sequence[torch.nn.Module], device: torch.device) -> None:
        seen, self.params = set(), []  # type: set, List[torch.nn.Parameter]
        for c in chunks:
            if hasattr(c, "ddp_config"):
                raise ValueError("ParkedParams: a DDP-wrapped model's parameters are views of its buffers; "
                                 "parking them would free nothing")
            for name, p in c.named_parameters():
                if p.requires_grad:
                    raise ValueError(f"ParkedParams: parameter {name} requires grad; parked parameters are "
                                     f"read-only (their host copy is kept, a change on the device would be lost)")
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)
        self.device = torch.device(device)
        self.host: List[torch.Tensor] = []
        """Each parameter's host copy (pinned when the device is CUDA), made at the first park and kept."""
        self.parked = False
        self.park()

    def park(self) -> None:
        """Every parameter's ``.data`` becomes its host copy (copied from the device at the first park only)."""
        if not self.host:
            pin = self.device.type == "cuda"
            with torch.no_grad():
                for p in self.params:
                    host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
                    host.copy_(p.data)
                    self.host.append(host)
        for p, host in zip(self.params, self.host):
            p.data = host
        self.parked = True

    def unpark(self) -> None:
        """Every parameter's ``.data`` becomes a new device copy of its host copy; checks that none is left elsewhere."""
        with torch.no_grad():
            for p, host in zip(self.params, self.host):
                p.data = host.to(self.device, copy=True)
        wrong = [tuple(p.shape) for p in self.params if p.device != self.device]
        if wrong:
            raise RuntimeError(f"ParkedParams: {len(wrong)} parameter(s) not on {self.device} after unpark")
        self.parked = False

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The parameters on the device inside the block, parked again after it (also on an exception, in the
        unpark included: a failed copy leaves nothing on the device)."""
        try:
            self.unpark()
            yield
        finally:
            self.park()

    def host_bytes(self) -> int:
        """Bytes the parked parameters take (in host memory while parked)."""
        return sum(p.numel() * p.element_size() for p in self.params)
