"""The waits of a step's rollout phase, derived from the generation rounds it may take.

Rank 0 generates a step's rollouts alone; every other rank waits for them -- in one collective (bounded by the
process-group timeout, ``trainer.collective_timeout_s``) under the watchdog (``trainer.phase_timeout_s``). With
dynamic sampling (``algorithm.filter_groups.enable``) that phase is up to ``max_num_gen_batches`` generation
rounds, each as long as a step's whole rollout phase without it, so both bounds are per round there:

    generation_rounds(cfg)          # max_num_gen_batches with dynamic sampling, else 1
    rollout_phase_timeout_s(cfg)    # rounds x trainer.phase_timeout_s: the watchdog of the rollout phase (0: none)
    rollout_wait_timeout_s(cfg)     # rounds x trainer.collective_timeout_s: the other ranks' wait for rank 0
    rollout_wait_cause(cfg)         # what they wait for, named in their error when that wait fails
    rollout_waits_line(cfg)         # ``megatron-rl check``'s line (None without dynamic sampling)

Every other collective keeps ``collective_timeout_s`` (a dead rank is still found that fast).
"""
from __future__ import annotations

__all__ = ["generation_rounds", "rollout_phase_timeout_s", "rollout_wait_timeout_s", "rollout_phase_key",
           "rollout_wait_cause", "rollout_waits_line"]


def generation_rounds(cfg) -> int:
    """Generation rounds a step's rollout phase may take on rank 0."""
    fg = cfg.algorithm.filter_groups
    return max(1, int(fg.max_num_gen_batches)) if fg.enable else 1


def rollout_phase_timeout_s(cfg) -> float:
    """The watchdog limit of the rollout phase on every rank: ``trainer.phase_timeout_s`` per round (0: none)."""
    return generation_rounds(cfg) * float(cfg.trainer.phase_timeout_s)


def rollout_wait_timeout_s(cfg) -> float:
    """The bound of the other ranks' wait for rank 0's rollouts: ``trainer.collective_timeout_s`` per round."""
    return generation_rounds(cfg) * float(cfg.trainer.collective_timeout_s)


def _per_round(cfg, key: str) -> str:
    value = getattr(cfg.trainer, key)
    rounds = generation_rounds(cfg)
    if rounds == 1:
        return f"trainer.{key}={value:g}"
    return f"trainer.{key}={value:g} per generation round x algorithm.filter_groups.max_num_gen_batches={rounds}"


def rollout_phase_key(cfg) -> str:
    """The keys behind ``rollout_phase_timeout_s``, for the watchdog's message."""
    return _per_round(cfg, "phase_timeout_s")


def rollout_wait_cause(cfg, step: int) -> str:
    """What a rank other than 0 waits for in step ``step`` (1-based) and what bounds the wait."""
    rounds = generation_rounds(cfg)
    gen = (f"up to {rounds} generation rounds of dynamic sampling (algorithm.filter_groups.max_num_gen_batches)"
           if rounds > 1 else "one generation round")
    return (f"waiting for rank 0's rollouts of step {step} (rank 0 generates them alone: {gen}); this wait is "
            f"bounded by {rollout_wait_timeout_s(cfg):g} s ({_per_round(cfg, 'collective_timeout_s')}): raise "
            f"trainer.collective_timeout_s if a round takes longer, or look in rank 0's log for why it stopped")


def rollout_waits_line(cfg) -> "str | None":
    """``megatron-rl check``: the rollout phase's bounds with dynamic sampling (None without it)."""
    rounds = generation_rounds(cfg)
    if rounds == 1:
        return None
    phase = rollout_phase_timeout_s(cfg)
    return (f"rollout waits: up to {rounds} generation rounds per step on rank 0 alone "
            f"(algorithm.filter_groups.max_num_gen_batches); the rollout phase's watchdog "
            f"{f'{phase:g} s' if phase > 0 else 'off'} ({rollout_phase_key(cfg)}), the other ranks' wait for it "
            f"{rollout_wait_timeout_s(cfg):g} s ({_per_round(cfg, 'collective_timeout_s')})")
