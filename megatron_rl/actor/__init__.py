"""The Megatron actor: rollout batch layout, log-prob pass, train step, checkpoints, HF export.

Modules (one job each):
  batch       ``RolloutBatch`` token layout ([B, L] tokens; per-token tensors [B, L-1], column t
              scores token t+1), micro-batch / DP splitting
  cp          context-parallel zigzag split / gather (megatron's convention)
  batcher     ``MicroBatcher``: padded / packed, token budget / fixed rows, interleaved or not, chosen once
              per actor (the plan, the cut, the DP token balance)
  schedule    micro-batch model inputs and one call of megatron's pipeline schedule
  forward     the log-prob pass (forward-only, vocab-parallel log-probs + entropy, PP broadcast)
  train_step  one optimizer step of the policy loss (1F1B, Megatron DDP + optimizer, clipping)
  optimizer   Megatron DDP wrapping and ``get_megatron_optimizer``
  lr_schedule warm-up / decay of the learning rate (megatron-core's ``OptimizerParamScheduler``)
  checkpoint  save / resume (model, optimizer, RNG, extra state)
  router_replay  the hooks in megatron's MoE routers that replay / record routing
  replay_modes   the routing-replay modes (``NoReplay``, ``R2``, ``R3``), chosen once by ``replay_mode``
  hf_io       export a saved checkpoint to a HF directory (live HF in / out: ``megatron_rl.convert.live``)
  actor       ``MegatronActor``, the facade used by the RL loop
  critic      ``MegatronCritic``: PPO's value model on the actor's machinery (value_head: the [h -> 1] output
              layer; value_pass: values and the value-loss step)

Tests: ``pytest tests/*/test_actor*.py``.
"""
from megatron_rl.actor.actor import MegatronActor
from megatron_rl.actor.batch import BatchError, RolloutBatch, row_blocks, scatter_rows

__all__ = ["MegatronActor", "RolloutBatch", "BatchError", "row_blocks", "scatter_rows"]
