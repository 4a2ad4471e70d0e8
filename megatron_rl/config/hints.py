"""Messages for unknown config keys: this project's key for names users bring from verl (read from the verl
key table, :mod:`megatron_rl.config.verl_keys`) / Megatron-LM, a key of another section, or the nearest valid
spelling.

    unknown_key_message("actor", "learning_rate", ["lr", ...], all_fields)
    # "actor.learning_rate: unknown key (this project's key is actor.lr)"
"""
from __future__ import annotations

import difflib
from typing import Dict, Mapping, Optional, Sequence

from megatron_rl.config.verl_keys import hint_entries

#: Megatron-LM's argument names (and section names users bring) -> (this project's dotted key, note) or
#: (None, why it has no key). verl's names come from :mod:`megatron_rl.config.verl_keys` (``FOREIGN_KEYS``).
MEGATRON_LM_KEYS: Dict[str, tuple] = {
    "learning_rate": ("actor.lr", ""),
    "optim": ("actor.lr", "optimizer settings are flat keys of actor: lr, weight_decay, adam_beta1/2, clip_grad"),
    "lr_scheduler_type": ("actor.lr_decay_style", "constant, linear, cosine or inverse-square-root"),
    "lr_warmup_iters": ("actor.lr_warmup_steps", "counted in optimizer steps"),
    "lr_decay_iters": ("actor.lr_decay_steps", "counted in optimizer steps"),
    "max_grad_norm": ("actor.clip_grad", ""),
    "micro_batch_size": ("actor.micro_batch_size", ""),
    "rl_use_sequence_packing": ("actor.sequence_packing", ""),
    "rl_sequence_packing_bin_size": ("actor.max_tokens_per_micro_batch", ""),
    "global_batch_size": ("data.prompts_per_step", "sequences per step = data.prompts_per_step x "
                                                   "rollout.n_samples_per_prompt"),
    "train_iters": ("trainer.steps", ""),
    "rollout_n": ("rollout.n_samples_per_prompt", ""),
    "max_tokens": ("rollout.max_new_tokens", ""),
    "model_path": ("actor.load_hf", ""),
    "pretrained_checkpoint": ("actor.load_hf", ""),
    "load": ("actor.load_hf", "an HF directory (or a `megatron-rl convert hf-to-mcore` output); "
                              "resume a run with trainer.resume"),
    "save": ("trainer.run_dir", "checkpoints go to trainer.run_dir/checkpoints"),
    "bf16": ("actor.bf16", ""),
    "fp16": (None, "not supported yet: the actor trains in fp32 or bf16 (actor.bf16); rollout.dtype sets the "
                   "embedded engine's dtype"),
    "params_dtype": ("actor.bf16", "bf16 parameters with fp32 main weights; false: fp32"),
    "accumulate_allreduce_grads_in_fp32": (None, "no meaning here: always on, gradients are accumulated and "
                                                 "all-reduced in fp32"),
    "seed": ("trainer.seed", ""),
}


def _foreign_keys() -> Dict[str, tuple]:
    """verl's names (first rule of the table wins per name), then Megatron-LM's."""
    out: Dict[str, tuple] = {}
    for key, target, note in hint_entries():
        out.setdefault(key, (target, note))
    for key, entry in MEGATRON_LM_KEYS.items():
        out.setdefault(key, entry)
    return out


#: Hint key (a name, or ``section.name`` for what a name means in that section only: verl's
#: ``rollout.tensor_model_parallel_size`` is the servers', not the trainer's) -> (this project's dotted key or
#: None, the note; for None the note is the whole reason).
FOREIGN_KEYS: Dict[str, tuple] = _foreign_keys()


def _foreign(section: str, key: str) -> Optional[str]:
    entry = FOREIGN_KEYS.get(f"{section}.{key}") or FOREIGN_KEYS.get(key)
    if entry is None:
        return None
    target, note = entry
    if target is None:
        return note
    if target == f"{section}.{key}":
        return None  # it IS a key of this section; the caller's section must be a different one
    return f"this project's key is {target}" + (f" ({note})" if note else "")


def unknown_key_message(section: str, key: str, valid: Sequence[str],
                        other_sections: Optional[Mapping[str, Sequence[str]]] = None) -> str:
    """``"<section>.<key>: unknown key (<hint>)"``; the hint names this project's key for a verl /
    Megatron-LM name, the section that holds ``key``, or the nearest valid key of ``section``."""
    where = f"{section}.{key}" if section else key
    hint = _foreign(section, key)
    if hint is None and other_sections:
        homes = [s for s, names in other_sections.items() if s != section and key in names]
        if homes:
            hint = "it belongs to " + " / ".join(f"{s}.{key}" for s in homes)
    if hint is None:
        near = difflib.get_close_matches(key, list(valid), n=1)
        if near:
            hint = f"did you mean {near[0]!r}?"
    if hint is None:
        hint = f"valid keys: {', '.join(valid)}"
    return f"{where}: unknown key ({hint})"
