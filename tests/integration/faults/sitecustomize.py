"""Fault injection for ``tests/integration/test_failures.py`` — faults real components cannot be made to produce on
demand (a disk error in one rank's checkpoint writer, a rank SIGKILLed mid-step, ...).

Python imports ``sitecustomize`` at start-up from ``sys.path``; the tests put this folder on PYTHONPATH of
a ``launch/torchrun.sh`` job and set ``MEGATRON_RL_FAULT=<kind>:<rank>:<step>``. Only training ranks
(``RANK`` set) are touched; the torchrun agent and every other process start as usual. When the fault
fires, the rank prints ``FAULT <kind> rank=<r> step=<s> t=<unix time>`` to stderr so a test can measure
how long the job took to end after it.

Kinds (``step`` counts ``MegatronActor.train_step`` calls of this process, 1-based; for checkpoint faults
it is the step whose checkpoint is written):

* ``ckpt_write_error``  the checkpoint file writer raises ``OSError(ENOSPC)`` on that rank
* ``ckpt_hang``         the checkpoint file writer blocks forever on that rank (the issue's hang)
* ``kill``              the rank SIGKILLs itself at the start of that train step
* ``loss_raise``        the policy loss raises on that rank, inside megatron's schedule
* ``train_hang``        the rank blocks forever at the start of that train step
* ``sync_error``        rank 0's embedded engine refuses the weights of that step (version step-<s>)
* ``setup_pause``       the rank pauses <s> seconds while its job is built, before its process group exists
* ``start_pause``       the rank pauses <s> seconds as its interpreter starts (here), before any project code runs:
                        before its stop watcher exists, so a stop signal then meets the disposition the rank
                        inherited from the torchrun agent
"""
import os

_SPEC = os.environ.get("MEGATRON_RL_FAULT")


def _install(kind: str, rank: int, step: int) -> None:
    import errno
    import signal
    import sys
    import threading
    import time

    def fire() -> None:
        print(f"FAULT {kind} rank={rank} step={step} t={time.time():.3f}", file=sys.stderr, flush=True)

    if kind in ("ckpt_write_error", "ckpt_hang"):
        from megatron_rl.platform import checkpoint_writer

        real = checkpoint_writer.write_bucket

        def write_bucket(transform_list, use_msc, bucket):
            if f"step_{step}{os.sep}" in bucket[0]:
                fire()
                if kind == "ckpt_hang":
                    threading.Event().wait()
                raise OSError(errno.ENOSPC, "No space left on device (injected by tests/integration/faults)", bucket[0])
            return real(transform_list, use_msc, bucket)

        checkpoint_writer.write_bucket = write_bucket
        return
    if kind == "start_pause":
        fire()
        time.sleep(step)
        return
    if kind == "setup_pause":
        from megatron_rl.trainer import job

        real_check = job.check_data

        def check_data(cfg):
            fire()
            time.sleep(step)
            return real_check(cfg)

        job.check_data = check_data
        return
    if kind == "sync_error":
        from megatron_rl.rollout.embedded import EmbeddedEngine

        real_begin = EmbeddedEngine.begin_weight_sync

        def begin(self, version, *args, **kwargs):
            if version == f"step-{step}":
                fire()
                raise RuntimeError(f"engine refused weights {version} (injected by tests/integration/faults)")
            return real_begin(self, version, *args, **kwargs)

        EmbeddedEngine.begin_weight_sync = begin
        return
    from megatron_rl.actor import train_step as train_step_module
    from megatron_rl.actor.actor import MegatronActor

    calls = {"n": 0}
    real_train_step = MegatronActor.train_step

    def train_step(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == step and kind == "kill":
            fire()
            os.kill(os.getpid(), signal.SIGKILL)
        if calls["n"] == step and kind == "train_hang":
            fire()
            threading.Event().wait()
        return real_train_step(self, *args, **kwargs)

    MegatronActor.train_step = train_step
    if kind == "loss_raise":
        real_loss = train_step_module.compute_policy_loss

        def compute_policy_loss(*args, **kwargs):
            if calls["n"] == step:
                fire()
                raise RuntimeError("policy loss failed (injected by tests/integration/faults)")
            return real_loss(*args, **kwargs)

        train_step_module.compute_policy_loss = compute_policy_loss
    elif kind not in ("kill", "train_hang"):
        raise ValueError(f"MEGATRON_RL_FAULT: unknown kind {kind!r}")


if _SPEC and "RANK" in os.environ:
    _kind, _rank, _step = _SPEC.split(":")
    if int(os.environ["RANK"]) == int(_rank):
        _install(_kind, int(_rank), int(_step))
