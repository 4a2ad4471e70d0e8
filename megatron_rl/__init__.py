"""megatron-rl: RL post-training backend on Megatron-Core.

Layout (the README's "Layout" table has every folder):
  megatron_rl.config      typed job config, YAML + dotted overrides, one validation pass
  megatron_rl.rollout     engines (SGLang over HTTP, embedded), weight receivers, routing capture
  megatron_rl.actor       the Megatron actor: log-prob pass, train step, checkpoints, routing replay
  megatron_rl.convert     the one owner of HF / checkpoint knowledge (load, gather, export)
  megatron_rl.correction  rollout-vs-training mismatch correction (IS weights, RS masks, metrics)
  megatron_rl.losses      policy losses (decoupled / bypass PPO-clip, REINFORCE), KL penalties
  megatron_rl.logprobs    vocab-parallel log-probs and entropy (fused, memory-bounded)
  megatron_rl.trainer     the RL loop, async rollouts, weight sync, watchdog and signals, metric sinks
  megatron_rl.parallel    launcher environment, process groups, parallel config
  megatron_rl.platform    CPU patches for megatron-core, the checkpoint writer, SGLang's CPU stand-ins
  megatron_rl.testing     multi-rank test launcher (forked gloo ranks with a timeout)
"""
__version__ = "0.1.0"
