"""CPU stand-in for megatron-core's ``HybridDeviceOptimizer`` (``actor.optimizer_cpu_offload``): the CPU is its
device. megatron offloads only ``param.is_cuda`` tensors and pins host memory; on a CPU nothing is CUDA, so its
CPU optimizers get parameters with no device copy and the first step fails (``KeyError`` in
``_set_sub_optimizer_grads``). The stand-in is megatron's own source with those tests removed: every offloaded
parameter still gets a separate host copy, stepped by its CPU AdamW and copied back by its hooks -- the path a GPU
job runs, minus the transfers. Applied by the actor's optimizer builder on a CPU run with offload; a megatron-core whose source differs is
refused by name (never silently patched).
"""
from __future__ import annotations

import inspect
import textwrap

from megatron_rl.platform.registry import PATCHES

__all__ = ["apply_cpu_hybrid_optimizer", "CPU_AS_DEVICE"]

#: (method, [(text of megatron's source, replacement)]): what makes the CPU the device for HybridDeviceOptimizer
CPU_AS_DEVICE = (("_get_sub_optimizer_param_groups", (("if param.is_cuda])", "])"), ("and param.is_cuda:", ":"),
                                                     ("if param.is_cuda:", "if not cpu_copy:"),
                                                     (".pin_memory()", ""))),
                 ("_move_new_state_to_right_device", (('v.to("cuda")', 'v.to("cpu")'),)))


def apply_cpu_hybrid_optimizer() -> None:
    """Make the CPU the device of megatron's ``HybridDeviceOptimizer`` (idempotent). Raises RuntimeError naming
    the method when megatron's source is not the one the stand-in edits."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H

    cls = H.HybridDeviceOptimizer
    if getattr(cls, "_mrl_cpu_as_device", False):
        return
    new = {}
    for name, edits in CPU_AS_DEVICE:
        src = textwrap.dedent(inspect.getsource(getattr(cls, name)))
        for old, repl in edits:
            if old not in src:
                raise RuntimeError(f"megatron-core's HybridDeviceOptimizer.{name} changed ({old!r} not found): "
                                   f"actor.optimizer_cpu_offload cannot run on CPU with this megatron-core")
            src = src.replace(old, repl)
        scope: dict = {}
        exec(src, H.__dict__, scope)  # noqa: S102 - megatron's own method, edited as listed above
        new[name] = scope[name]
    for name, fn in new.items():
        setattr(cls, name, fn)
        PATCHES[f"{H.__name__}.HybridDeviceOptimizer.{name}"] = (
            "offloads only param.is_cuda tensors and pins host memory: on a CPU the CPU is its device")
    cls._mrl_cpu_as_device = True
