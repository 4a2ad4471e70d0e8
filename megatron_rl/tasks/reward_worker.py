"""``python -m megatron_rl.tasks.reward_worker``: one reward worker process of ``reward_pool.RewardPool``.

Protocol on stdin / stdout: length-prefixed pickles. The worker warms the rewards (imports math-verify
and parses once), writes ``"ready"``, then for each ``RewardJob`` read writes ``(ok, reward or error
message)``. Anything the reward functions print goes to stderr (stdout carries only the protocol). It
exits when stdin closes.
"""
from __future__ import annotations

from megatron_rl.tasks.reward_pool import run_job
from megatron_rl.tasks.rewards import warmup
from megatron_rl.worker_pipes import read_frame, worker_streams, write_frame


def main() -> None:
    """Serve jobs until stdin closes."""
    proto_in, proto_out = worker_streams()  # prints of user rewards go to stderr
    warmup()
    write_frame(proto_out, "ready")
    while True:
        try:
            job = read_frame(proto_in)
        except EOFError:
            return
        write_frame(proto_out, run_job(job))


if __name__ == "__main__":
    main()
