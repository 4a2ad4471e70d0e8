"""The rollout phase's bounds scale with the generation rounds dynamic sampling may take (``config.timeouts``):
the watchdog limit every rank runs the phase under (``step.train_step``) is ``trainer.phase_timeout_s`` per round,
the other ranks' wait ``trainer.collective_timeout_s`` per round (its behaviour: tests/integration/
test_rollout_wait.py), each named with the keys behind it."""
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from megatron_rl.config import job_config_from_dict


def _cfg(enable, rounds=7, phase=100.0, collective=60.0):
    return job_config_from_dict({"trainer": {"phase_timeout_s": phase, "collective_timeout_s": collective},
                                 "algorithm": {"filter_groups": {"enable": enable, "max_num_gen_batches": rounds}}})


class _Stop(Exception):
    pass


def _rollout_phase(cfg):
    """The (timeout_s, config_key) ``train_step`` runs its rollout phase under."""
    from megatron_rl.trainer.step import train_step

    seen = {}

    class Watchdog:
        @contextmanager
        def phase(self, name, step, timeout_s=None, config_key=None):
            seen[name] = (timeout_s, config_key)
            yield

    def stop(step):
        raise _Stop

    job = SimpleNamespace(cfg=cfg, actor=None, watchdog=Watchdog(), source=SimpleNamespace(next=stop))
    with pytest.raises(_Stop):
        train_step(job, 0)
    return seen["rollout"]


def test_rollout_phase_gets_phase_timeout_per_round():
    limit, key = _rollout_phase(_cfg(True))
    assert limit == 7 * 100.0
    assert key == ("trainer.phase_timeout_s=100 per generation round x "
                   "algorithm.filter_groups.max_num_gen_batches=7")
    limit, key = _rollout_phase(_cfg(False))  # one round: the plain key
    assert (limit, key) == (100.0, "trainer.phase_timeout_s=100")
    assert _rollout_phase(_cfg(True, phase=0))[0] == 0  # 0: no limit stays no limit


def test_wait_for_rank0_is_collective_timeout_per_round():
    from megatron_rl.config.timeouts import rollout_wait_cause, rollout_wait_timeout_s

    assert rollout_wait_timeout_s(_cfg(True)) == 7 * 60.0 and rollout_wait_timeout_s(_cfg(False)) == 60.0
    cause = rollout_wait_cause(_cfg(True), 3)
    assert "rank 0's rollouts of step 3" in cause and "up to 7 generation rounds" in cause
    assert "bounded by 420 s (trainer.collective_timeout_s=60 per generation round x " in cause


def test_check_line_states_the_derived_waits():
    from megatron_rl.config.timeouts import rollout_waits_line

    assert rollout_waits_line(_cfg(False)) is None
    line = rollout_waits_line(_cfg(True))
    assert "up to 7 generation rounds" in line and "watchdog 700 s" in line and "wait for it 420 s" in line, line
    assert "drain" not in line                                  # sync: no checkpoint drain
    cfg = _cfg(True)
    cfg.rollout.mode = "async"
    line = rollout_waits_line(cfg)                              # checkpoint_timeout_s: the default 1800
    assert "async checkpoint's drain 6300 s on rank 0" in line and "wait for it 6360 s" in line, line
    assert "checkpoint's watchdog 7260 s" in line, line


class _Producer:
    """The async producer's stand-in: records each snapshot's bound."""

    instances = []

    def __init__(self, *args, **kwargs):
        self.bounds = []
        _Producer.instances.append(self)

    def start_thread(self):
        return self

    def snapshot(self, next_step, timeout_s=None, ready_only=False):
        self.bounds.append(timeout_s)
        return {}

    def close(self):
        pass


def test_async_checkpoint_drain_and_watchdog_cover_every_round(monkeypatch, capsys):
    """An async checkpoint waits for up to rollout.max_staleness steps of rollouts, each up to max_num_gen_batches
    rounds: rank 0's drain gets half of trainer.checkpoint_timeout_s per round (7 x 100 / 2 = 350 s, not 50), and
    the checkpoint's watchdog covers the other ranks' wait for it (350 + collective 60) and the save (100 / 2)."""
    from megatron_rl.trainer import job as job_mod
    from megatron_rl.trainer import rollout_source

    monkeypatch.setattr(rollout_source, "RolloutProducer", _Producer)
    monkeypatch.setattr(job_mod, "save", lambda *args, **kwargs: "ckpt")
    seen = {}

    class Watchdog:
        @contextmanager
        def phase(self, name, step, timeout_s=None, config_key=None):
            seen[name] = (timeout_s, config_key)
            yield

    for enable, drain, phase in ((True, 7 * 100 / 2, 100 / 2 + 7 * 100 / 2 + 60), (False, 100 / 2, 100 + 60)):
        cfg = job_config_from_dict({"trainer": {"phase_timeout_s": 100.0, "collective_timeout_s": 60.0,
                                                "checkpoint_timeout_s": 100.0, "steps": 10},
                                    "rollout": {"mode": "async", "max_staleness": 2},
                                    "algorithm": {"filter_groups": {"enable": enable, "max_num_gen_batches": 7}}})
        source = rollout_source.AsyncRollouts(cfg, None, None, None, 0, {}, True,
                                              publisher=SimpleNamespace(producer=None))
        job = job_mod.Job(cfg=cfg, plan=None, actor=None, reference=None, source=source, watchdog=Watchdog(), sinks=None,
                          stop=SimpleNamespace(signum=None), start_step=0, pad_id=0, rank0=True)
        job.checkpoint(2, stopping=False)
        assert _Producer.instances[-1].bounds == [drain]
        assert seen["checkpoint"][0] == phase
    assert "trainer.checkpoint_timeout_s" in seen["checkpoint"][1]
