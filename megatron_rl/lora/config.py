"""``LoraConfig``: the ``actor.lora`` section (verl / PEFT names), validated on construction; ``rank: 0`` is off.

Rule: the target names are megatron-core's module names; the HF / PEFT aliases (``q_proj`` ...) are mapped to them
here, once (``names.py`` finds the modules), so every later reader sees megatron-core names only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["LoraConfig", "mcore_targets", "MCORE_TARGETS", "HF_ALIASES", "ALL_LINEAR", "INITS"]

#: megatron-core module names an adapter can target
MCORE_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "linear_q_proj", "linear_q_down_proj",
                 "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
#: every linear layer of a block (PEFT's ``all-linear``; never the output layer or the embedding)
ALL_LINEAR = "all-linear"
#: HF / PEFT module names -> the megatron-core module that holds them (q/k/v in one qkv, gate/up in one fc1)
HF_ALIASES = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
              "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
              "w1": "linear_fc1", "w3": "linear_fc1", "w2": "linear_fc2"}
#: HF names that share one megatron-core module: all of a group or none
_TOGETHER = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
#: ``init`` values: PEFT's defaults (B zeros; A kaiming-uniform(a=sqrt(5)) as nn.Linear, or normal(0, 1/r))
INITS = ("kaiming", "gaussian")


def mcore_targets(entries: Sequence[str]) -> Tuple[Tuple[str, str], ...]:
    """((entry as written, megatron-core module name), ...) for every ``target_modules`` entry of ``entries``
    (``all-linear``: every name; an HF name: the module that holds it)."""
    out = []
    for t in entries:
        if t == ALL_LINEAR:
            out += [(t, m) for m in MCORE_TARGETS]
        else:
            out.append((t, HF_ALIASES.get(t, t)))
    return tuple(out)


@dataclass
class LoraConfig:
    """Low-rank adapters on the actor's linear layers (``actor.lora``): y = base(x) + alpha/rank * B(A(dropout(x)))."""

    rank: int = 0
    """Adapter rank r (verl's ``lora_rank``, PEFT's ``r``); 0: no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator (verl's ``lora_alpha``, PEFT's ``lora_alpha``): the delta is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input (PEFT's ``lora_dropout``), in [0, 1); only in training forwards."""
    target_modules: List[str] = field(default_factory=lambda: [ALL_LINEAR])
    """Modules that get adapters: megatron-core names (``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2``, MLA's ``linear_q_proj`` / ``linear_q_down_proj`` / ``linear_q_up_proj`` /
    ``linear_kv_down_proj`` / ``linear_kv_up_proj``), HF names (``q_proj``, ``k_proj``, ``v_proj`` -> linear_qkv,
    ``o_proj`` -> linear_proj, ``gate_proj``, ``up_proj`` -> linear_fc1, ``down_proj`` -> linear_fc2) or
    ``all-linear``. ``linear_fc1`` / ``linear_fc2`` cover dense MLPs, every routed expert and the shared experts.
    An entry that matches no module of the model is an error naming it."""
    init: str = "kaiming"
    """Initialisation of A (B is zeros, so the adapted model starts as the base): "kaiming" (PEFT's default,
    kaiming-uniform(a=sqrt(5)) as nn.Linear) or "gaussian" (normal(0, 1/rank)); seeded by ``trainer.seed`` so the
    unsharded A is the same at every TP / EP / PP."""

    def __post_init__(self) -> None:
        errs = self.errors()
        if errs:
            raise ValueError("; ".join(errs))

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "LoraConfig":
        """Build from the (checked) keys of the YAML block; an empty or null block is off (rank 0)."""
        return cls(**dict(d or {}))

    @property
    def enabled(self) -> bool:
        """Adapters are on (rank > 0)."""
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """alpha / rank (PEFT's ``scaling``)."""
        return self.alpha / self.rank

    def errors(self) -> List[str]:
        """Violations, each naming its dotted key."""
        key, errs = "actor.lora", []
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            errs.append(f"{key}.rank: must be an integer >= 0 (0: off), got {self.rank!r}")
        if not self.alpha > 0:
            errs.append(f"{key}.alpha: must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            errs.append(f"{key}.dropout: must be in [0, 1), got {self.dropout!r}")
        if self.init not in INITS:
            errs.append(f"{key}.init: must be one of {', '.join(INITS)}, got {self.init!r}")
        if isinstance(self.target_modules, str):
            errs.append(f"{key}.target_modules: must be a list of module names, got the string "
                        f"{self.target_modules!r} (write [{self.target_modules}])")
        elif not self.target_modules:
            errs.append(f"{key}.target_modules: empty (give module names or [all-linear])")
        else:
            known = set(MCORE_TARGETS) | set(HF_ALIASES) | {ALL_LINEAR}
            bad = [t for t in self.target_modules if t not in known]
            if bad:
                errs.append(f"{key}.target_modules: unknown {', '.join(map(repr, bad))}; known: "
                            f"{', '.join(MCORE_TARGETS)}, {', '.join(HF_ALIASES)}, {ALL_LINEAR}")
            for group in _TOGETHER:
                given = [t for t in group if t in self.target_modules]
                if given and len(given) < len(group):
                    errs.append(f"actor.lora.target_modules: {', '.join(given)} without "
                                f"{', '.join(t for t in group if t not in given)}: megatron-core holds "
                                f"{' / '.join(group)} in one module ({HF_ALIASES[group[0]]}), whose adapter adapts all "
                                f"of them; list them together (or write {HF_ALIASES[group[0]]})")
        return errs

    def mcore_targets(self) -> Tuple[Tuple[str, str], ...]:
        """((entry as written, megatron-core module name), ...) for every entry (``all-linear``: every name)."""
        return mcore_targets(self.target_modules)

    def to_dict(self) -> Dict[str, Any]:
        """The section as the YAML writes it (saved with checkpoints and adapters)."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "init": self.init}
