"""The optimizers inside megatron's optimizer (a ``ChainedOptimizer`` of dense and expert ones, or one alone): the
one place the actor modules walk them (checkpoints, optimizer-state conversion, main parameters)."""
from __future__ import annotations

__all__ = ["sub_optimizers", "torch_optimizers"]


def sub_optimizers(optimizer) -> list:
    """megatron's optimizers inside ``optimizer``, in order: one per entry of a chained optimizer's state dict
    (its ``chained_optimizers``), or ``[optimizer]``."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return list(chained) if chained is not None else [optimizer]


def torch_optimizers(optimizer) -> list:
    """The torch optimizer of each of ``sub_optimizers``, positions kept: None where megatron built none."""
    return [getattr(o, "optimizer", None) for o in sub_optimizers(optimizer)]
