"""The actor's activation recomputation (``actor.recompute_*``, megatron-core's TransformerConfig names): checked
once here with megatron-core's rules before anything is built; the builder passes it to TransformerConfig and
``megatron-rl check`` plans the memory it saves.

One rule is stricter than megatron-core's: a key that has no effect at the chosen granularity (a method or a
layer count without ``full``, modules without ``selective``) is an error, not silently ignored.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["Recompute", "GRANULARITIES", "METHODS", "MODULES"]

GRANULARITIES = ("full", "selective")
"""megatron-core's ``recompute_granularity`` values (None: no recomputation)."""
METHODS = ("uniform", "block")
"""megatron-core's ``recompute_method`` values (full recomputation only)."""
MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
"""megatron-core's ``recompute_modules`` (selective recomputation; megatron's default ["core_attn"])."""


@dataclass(frozen=True)
class Recompute:
    """One actor's recomputation settings (the ``actor.recompute_*`` keys)."""

    granularity: Optional[str] = None
    """``recompute_granularity``: None (keep every activation), "full" (keep each recomputed layer group's
    input, run its forward again in backward) or "selective" (recompute ``modules`` only)."""
    method: Optional[str] = None
    """``recompute_method`` (full only): "uniform" (layers in groups of ``num_layers``, each group's input kept)
    or "block" (the first ``num_layers`` layers of each model chunk recomputed, the rest keep everything)."""
    num_layers: Optional[int] = None
    """``recompute_num_layers`` (full only): the group size (uniform) or layers per model chunk (block)."""
    modules: Optional[Tuple[str, ...]] = None
    """``recompute_modules`` (selective only; None: megatron's default, core_attn)."""

    @classmethod
    def from_actor(cls, actor: Any) -> "Recompute":
        """The settings of an ``ActorConfig``."""
        modules = actor.recompute_modules
        return cls(actor.recompute_granularity, actor.recompute_method, actor.recompute_num_layers,
                   tuple(modules) if modules is not None else None)

    @property
    def plan_mode(self) -> str:
        """What the memory plan calls it: "none", "selective" or "full"."""
        return self.granularity or "none"

    def errors(self, stage_layers: Sequence[int] = (), moe_grouped_gemm: bool = False,
               multi_latent_attention: bool = False, prefix: str = "actor.") -> List[str]:
        """Violations of megatron-core's rules (``TransformerConfig.__post_init__``), each naming its key.
        ``stage_layers``: layers per pipeline stage (bounds ``num_layers``)."""
        g, errs = self.granularity, []
        if g is not None and g not in GRANULARITIES:
            errs.append(f"{prefix}recompute_granularity: {g!r} is not one of full, selective (null: none)")
            return errs
        if g == "full":
            if self.method not in METHODS:
                errs.append(f"{prefix}recompute_method: recompute_granularity full needs uniform or block, got "
                            f"{self.method!r}")
            most = max(stage_layers, default=None)
            if self.num_layers is None or self.num_layers < 1 or (most is not None and self.num_layers > most):
                errs.append(f"{prefix}recompute_num_layers: recompute_granularity full needs it between 1 and the "
                            f"layers of a pipeline stage ({most if most is not None else 'num_layers'}), got "
                            f"{self.num_layers!r}")
        else:
            for key, value in (("recompute_method", self.method), ("recompute_num_layers", self.num_layers)):
                if value is not None:
                    errs.append(f"{prefix}{key}: {value!r} has no effect without recompute_granularity full "
                                f"(it is {g!r}); remove it")
        if self.modules is not None:
            if g != "selective":
                errs.append(f"{prefix}recompute_modules: {list(self.modules)} has no effect without "
                            f"recompute_granularity selective (it is {g!r}); remove it")
            bad = [m for m in self.modules if m not in MODULES]
            if bad:
                errs.append(f"{prefix}recompute_modules: {bad} not among megatron-core's {list(MODULES)}")
            if "moe_act" in self.modules and not moe_grouped_gemm:
                errs.append(f"{prefix}recompute_modules: moe_act needs model.moe_grouped_gemm (megatron-core)")
            if "mla_up_proj" in self.modules and not multi_latent_attention:
                errs.append(f"{prefix}recompute_modules: mla_up_proj needs multi-latent attention (megatron-core)")
        return errs

    def transformer_config_kwargs(self) -> Dict[str, Any]:
        """The TransformerConfig fields (none when nothing is recomputed)."""
        if self.granularity is None:
            return {}
        kw: Dict[str, Any] = {"recompute_granularity": self.granularity, "recompute_method": self.method,
                              "recompute_num_layers": self.num_layers}
        if self.modules is not None:
            kw["recompute_modules"] = list(self.modules)
        return kw
