"""The RL loop: rollout phase, loop, metric sinks, preemption handling."""
