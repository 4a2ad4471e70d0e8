"""A test environment for the judge's multi-turn test: it replies "7" to the first model turn and ends the episode
at the second with reward 0.25 (so every trajectory whose first turn stopped holds a tool reply)."""
from megatron_rl.envs.base import Environment, EnvStep


class ReplyOnce(Environment):
    def reset(self, sample):
        self.turn = 0

    def step(self, action):
        self.turn += 1
        return EnvStep(observation="7", done=False) if self.turn == 1 else EnvStep(observation="", reward=0.25,
                                                                                     done=True)
