"""Attach adapters to built megatron-core model chunks and freeze the base (``apply_lora``); the adapters-off
context (``adapters_disabled``) that turns the policy into the KL reference without a second model.

Rule: call on the bare chunks after the base weights are loaded and before megatron's DDP / optimizer are built
(they take only parameters with ``requires_grad``: the base gets no gradient buffer, no main parameters, no Adam).
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch

from megatron_rl.lora.config import LoraConfig
from megatron_rl.lora.layers import LoraLinear, init_full_A, lora_class
from megatron_rl.lora.names import KIND_OF, LoraTarget, LoraTargetError, find_targets, matched_entries

__all__ = ["LoraSpec", "apply_lora", "adapters_disabled", "lora_modules", "adapter_parameters"]


@dataclass(frozen=True)
class LoraSpec:
    """What the actor attaches: the ``actor.lora`` section and the seed of A's initialisation."""

    config: LoraConfig
    """The ``actor.lora`` section (enabled)."""
    seed: int
    """``trainer.seed``: with each module's canonical name, seeds its A."""


def _generator(seed: int, canonical: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(canonical.encode())) % (2 ** 63))
    return g


def apply_lora(chunks: Sequence[torch.nn.Module], spec: LoraSpec) -> List[LoraTarget]:
    """Freeze every parameter of ``chunks``, then give every targeted module its adapter (in place: the module's
    class becomes the adapted subclass, its parameters keep their names). Raises ``LoraTargetError`` naming an
    entry of ``actor.lora.target_modules`` that matches no module of this rank's layers."""
    cfg = spec.config
    targets = find_targets(chunks, cfg)
    has_layers = any(len(c.decoder.layers) for c in chunks if getattr(c, "decoder", None) is not None)
    if has_layers:
        matched = set(matched_entries(cfg, targets))
        missing = [t for t in cfg.target_modules if t not in matched]
        if missing:
            raise LoraTargetError(f"actor.lora.target_modules: {', '.join(map(repr, missing))} matches no module of "
                                  f"the model (its linear layers: "
                                  f"{', '.join(sorted(_linear_names(chunks))) or 'none'})")
    for c in chunks:
        c.requires_grad_(False)
    for t in targets:
        m = t.module
        tp_rank = 0 if m.tp_group is None else torch.distributed.get_rank(m.tp_group)
        full_A = init_full_A(cfg.rank, m.input_size, cfg.init, _generator(spec.seed, t.canonical))
        m.__class__ = lora_class(type(m), t.kind)
        glu = t.path.endswith("linear_fc1") and bool(getattr(m.config, "gated_linear_unit", False))
        m.attach(cfg.rank, cfg.scaling, cfg.dropout, full_A, tp_rank, glu=glu)
    return targets


def _linear_names(chunks) -> set:
    return {p.rsplit(".", 1)[-1] for c in chunks for p, _ in c.named_modules() if p.rsplit(".", 1)[-1] in KIND_OF}


def lora_modules(chunks: Sequence[torch.nn.Module]) -> Iterator[LoraLinear]:
    """Every adapted module of ``chunks`` (bare or DDP-wrapped)."""
    for c in chunks:
        for m in c.modules():
            if isinstance(m, LoraLinear):
                yield m


def adapter_parameters(chunks: Sequence[torch.nn.Module]) -> Iterator[torch.nn.Parameter]:
    """The A and B parameters of every adapted module."""
    for m in lora_modules(chunks):
        yield m.lora_A.weight
        yield m.lora_B.weight


@contextlib.contextmanager
def adapters_disabled(chunks: Sequence[torch.nn.Module]):
    """Run ``chunks`` as the base model (every adapter off) inside the block; restored on exit, also on error."""
    mods = list(lora_modules(chunks))
    before = [m.lora_enabled for m in mods]
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m, was in zip(mods, before):
            m.lora_enabled = was
