"""Messages for unknown config keys: this project's key for names users bring from verl / Megatron-LM,
a key of another section, or the nearest valid spelling.

    unknown_key_message("actor", "learning_rate", ["lr", ...], all_fields)
    # "actor.learning_rate: unknown key (this project's key is actor.lr)"
"""
from __future__ import annotations

import difflib
from typing import Dict, Mapping, Optional, Sequence

#: Names from verl (``actor_rollout_ref.*``, ``data.*``, ``trainer.*``) and Megatron-LM's arguments ->
#: (this project's dotted key or None, what to know about it). A ``section.key`` entry applies in that section only
#: and comes first (verl's ``rollout.tensor_model_parallel_size`` is the servers', not the trainer's).
FOREIGN_KEYS: Dict[str, tuple] = {
    # optimizer / schedule
    "learning_rate": ("actor.lr", ""),
    "optim": ("actor.lr", "optimizer settings are flat keys of actor: lr, weight_decay, adam_beta1/2, clip_grad"),
    "lr_decay_style": ("actor.lr_decay_style", "constant, linear, cosine or inverse-square-root"),
    "lr_scheduler_type": ("actor.lr_decay_style", "constant, linear, cosine or inverse-square-root"),
    "warmup_style": ("actor.lr_decay_style", "verl's warmup_style names the decay after the warm-up"),
    "lr_warmup_iters": ("actor.lr_warmup_steps", "counted in optimizer steps"),
    "lr_warmup_steps": ("actor.lr_warmup_steps", "counted in optimizer steps: training steps x actor.ppo_epochs x "
                                                 "actor.ppo_mini_batches (verl counts training steps)"),
    "lr_warmup_steps_ratio": ("actor.lr_warmup_fraction", "of actor.lr_decay_steps, by default the whole run"),
    "min_lr_ratio": ("actor.min_lr", "an absolute learning rate: min_lr_ratio x actor.lr"),
    "lr_decay_iters": ("actor.lr_decay_steps", "counted in optimizer steps"),
    "num_cycles": (None, "the cosine decays once, from actor.lr to actor.min_lr (verl's default num_cycles 0.5)"),
    "grad_clip": ("actor.clip_grad", ""),
    "max_grad_norm": ("actor.clip_grad", ""),
    "betas": ("actor.adam_beta1", "and actor.adam_beta2"),
    # batching / epochs
    "ppo_epochs": ("actor.ppo_epochs", ""),
    "ppo_mini_batch_size": ("actor.ppo_mini_batches", "a number of mini-batches per rollout batch, not a size"),
    "ppo_micro_batch_size": ("actor.micro_batch_size", "sequences per micro-batch on each rank"),
    "ppo_micro_batch_size_per_gpu": ("actor.micro_batch_size", "sequences per micro-batch on each rank"),
    "micro_batch_size": ("actor.micro_batch_size", ""),
    "ppo_max_token_len_per_gpu": ("actor.max_tokens_per_micro_batch", "token budget of one micro-batch per rank"),
    "log_prob_max_token_len_per_gpu": ("actor.max_tokens_per_micro_batch", "one budget serves both passes"),
    "use_dynamic_bsz": ("actor.max_tokens_per_micro_batch", "set the token budget (null: fixed rows)"),
    "use_remove_padding": ("actor.sequence_packing", "true packs each micro-batch's rows into one sequence"),
    "rl_use_sequence_packing": ("actor.sequence_packing", ""),
    "rl_sequence_packing_bin_size": ("actor.max_tokens_per_micro_batch", ""),
    "global_batch_size": ("data.prompts_per_step", "sequences per step = data.prompts_per_step x "
                                                   "rollout.n_samples_per_prompt"),
    "train_batch_size": ("data.prompts_per_step", "prompts per step over all ranks"),
    "train_iters": ("trainer.steps", ""),
    "total_training_steps": ("trainer.steps", ""),
    "total_epochs": ("trainer.steps", "training length is counted in steps"),
    # rollout
    "n": ("rollout.n_samples_per_prompt", ""),
    "rollout_n": ("rollout.n_samples_per_prompt", ""),
    "response_length": ("rollout.max_new_tokens", ""),
    "max_response_length": ("rollout.max_new_tokens", ""),
    "max_tokens": ("rollout.max_new_tokens", ""),
    "max_prompt_length": ("data.max_prompt_length", "longer prompts are filtered or truncated: data.overlong_prompts"),
    "prompt_length": ("data.max_prompt_length", "longer prompts are filtered or truncated: data.overlong_prompts"),
    "temperature": ("rollout.temperature", ""),
    "top_p": ("rollout.top_p", ""),
    "top_k": ("rollout.top_k", ""),
    "tensor_model_parallel_size": ("parallel.tensor_model_parallel_size", ""),
    "rollout.tensor_model_parallel_size": (None, "the SGLang servers' tensor parallelism is set where they start: "
                                                 "launch/sglang_server.sh --tp, SGLANG_TP of launch/slurm.sbatch; "
                                                 "parallel.tensor_model_parallel_size is the trainer's"),
    # model / checkpoints
    "path": ("actor.load_hf", "the HF checkpoint directory the actor starts from (verl's model.path)"),
    "model_path": ("actor.load_hf", ""),
    "pretrained_checkpoint": ("actor.load_hf", ""),
    "load": ("actor.load_hf", "an HF directory (or a `megatron-rl convert hf-to-mcore` output); "
                              "resume a run with trainer.resume"),
    "save": ("trainer.run_dir", "checkpoints go to trainer.run_dir/checkpoints"),
    "default_local_dir": ("trainer.run_dir", ""),
    "save_freq": ("trainer.save_interval", ""),
    "project_name": ("trainer.wandb_project", ""),
    "bf16": ("actor.bf16", ""),
    "fp16": (None, "the actor trains in fp32 or bf16 (actor.bf16); rollout.dtype sets the embedded engine's dtype"),
    "params_dtype": ("actor.bf16", "bf16 parameters with fp32 main weights; false: fp32"),
    "accumulate_allreduce_grads_in_fp32": (None, "always on: gradients are accumulated and all-reduced in fp32"),
    "use_distributed_optimizer": ("actor.use_distributed_optimizer", ""),
    # algorithm / loss
    "adv_estimator": ("algorithm.advantage_estimator", ""),
    "norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", ""),
    "use_kl_loss": ("actor.policy_loss.kl_loss_coef", "use_kl_loss is accepted inside actor.policy_loss"),
    "kl_loss_coef": ("actor.policy_loss.kl_loss_coef", ""),
    "clip_ratio": ("actor.policy_loss.clip_ratio", ""),
    "clip_ratio_low": ("actor.policy_loss.clip_ratio_low", ""),
    "clip_ratio_high": ("actor.policy_loss.clip_ratio_high", ""),
    "loss_agg_mode": ("actor.policy_loss.loss_agg_mode", ""),
    "loss_type": ("algorithm.rollout_correction.loss_type", ""),
    "loss_mode": ("algorithm.rollout_correction.loss_type", "verl's actor.policy_loss.loss_mode is moved there on load"),
    "clip_ratio_c": ("actor.policy_loss.clip_ratio_c", ""),
    "tau_pos": ("actor.policy_loss.tau_pos", ""),
    "tau_neg": ("actor.policy_loss.tau_neg", ""),
    "clip_cov_ratio": ("actor.policy_loss.clip_cov_ratio", ""),
    "kl_cov_ratio": ("actor.policy_loss.kl_cov_ratio", ""),
    "ppo_kl_coef": ("actor.policy_loss.ppo_kl_coef", ""),
    "dro_beta": ("actor.policy_loss.dro_beta", ""),
    "rollout_is": ("algorithm.rollout_correction.rollout_is", ""),
    "rollout_rs": ("algorithm.rollout_correction.rollout_rs", ""),
    "seed": ("trainer.seed", ""),
}


def _foreign(section: str, key: str) -> Optional[str]:
    here = FOREIGN_KEYS.get(f"{section}.{key}")
    entry = here or FOREIGN_KEYS.get(key)
    if entry is None:
        return None
    target, note = entry
    if target is None:
        return f"not a job config key: {note}" if here else f"not supported here: {note}"
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
