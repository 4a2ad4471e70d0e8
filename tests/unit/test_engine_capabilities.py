"""What the rollout engines declare (``base.RolloutEngine`` capabilities) and the factory mapping ``rollout.engine``.

References: the interface's own ``generate`` signature (every engine must match it); the embedded engine's
samples drawn twice (a seed must reproduce them, another seed must not, a second engine built with another
construction seed must agree with the first); the requests an SGLang engine sends (a fault-injecting stdlib
HTTP server: ``seed`` must change nothing); and the rule of weight-sync modes as it stood before engines declared
it (the hard-coded tables ``ACCEPTED`` / ``AUTO`` below: the old ``resolve_mode`` and validation checks).

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_engine_capabilities.py -q``
"""
from __future__ import annotations

import inspect

import pytest
from test_rollout_sglang_faults import FaultServer, ok

from megatron_rl.config import job_config_from_dict
from megatron_rl.plan import job_errors
from megatron_rl.rollout.base import WEIGHT_SYNC_MODES, RolloutEngine, SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.plan import job_engine as build_engine
from megatron_rl.rollout.factory import ENGINE_KINDS, engine_class
from megatron_rl.rollout.sglang_engine import SGLangEngine

ENGINES = {"embedded": EmbeddedEngine, "sglang": SGLangEngine}

#: (engine, rollout.mode) -> the explicit rollout.weight_sync values validation accepts (async in-memory syncs to
#: SGLang: rank 0's owned buckets, loaded by the producer between segments)
ACCEPTED = {
    ("embedded", "sync"): {"disk", "tensor"},
    ("embedded", "async"): {"disk", "tensor"},
    ("sglang", "sync"): {"disk", "tensor", "distributed"},
    ("sglang", "async"): {"disk", "tensor", "distributed"},
}
#: (engine, rollout.mode) -> what rollout.weight_sync: auto resolved to before this refactor
AUTO = {("embedded", "sync"): "tensor", ("embedded", "async"): "tensor",
        ("sglang", "sync"): "distributed", ("sglang", "async"): "disk"}

SP = SamplingParams(temperature=1.0, max_new_tokens=6)
PROMPTS = [[5, 6, 7], [40, 41]]


@pytest.mark.parametrize("cls", [EmbeddedEngine, SGLangEngine])
def test_generate_has_the_interface_signature(cls):
    assert inspect.signature(cls.generate) == inspect.signature(RolloutEngine.generate)
    assert list(inspect.signature(cls.generate).parameters) == ["self", "prompt_ids", "sampling", "n", "seed"]


def test_declared_sampling_capability():
    assert EmbeddedEngine.seeded_sampling is True and SGLangEngine.seeded_sampling is False


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megatron_rl.testing.tiny_hf import build_tiny_hf_model

    path = build_tiny_hf_model(tmp_path_factory.mktemp("caps") / "qwen2", arch="qwen2", seed=0)
    return path, EmbeddedEngine(path, dtype="float32", seed=0)


def _samples(rollouts):
    return [(r.response_ids, r.rollout_log_probs) for r in rollouts]


def test_embedded_seed_reproduces_a_sample(engine):
    path, eng = engine
    first = _samples(eng.generate(PROMPTS, SP, n=2, seed=11))
    assert _samples(eng.generate(PROMPTS, SP, n=2, seed=11)) == first
    other = EmbeddedEngine(path, dtype="float32", seed=123)  # another construction seed: the call seed decides
    assert _samples(other.generate(PROMPTS, SP, n=2, seed=11)) == first
    assert [ids for ids, _ in _samples(eng.generate(PROMPTS, SP, n=2, seed=12))] != [ids for ids, _ in first]
    assert [ids for ids, _ in _samples(eng.generate(PROMPTS, SP, n=2))] != [ids for ids, _ in first]


def test_sglang_accepts_and_ignores_seed():
    server = FaultServer()
    try:
        server.script = [ok()]
        eng = SGLangEngine(server.url, capture_routing=False)
        got = [_samples(eng.generate(PROMPTS, SP, n=2, seed=s)) for s in (None, 1, 2)]
        bodies = server.generate_calls()
    finally:
        server.close()
    assert len(bodies) == 3 and bodies[0] == bodies[1] == bodies[2]
    assert got[0] == got[1] == got[2]


@pytest.mark.parametrize("kind", sorted(ENGINES))
def test_factory_maps_each_kind(kind):
    assert engine_class(kind) is ENGINES[kind]
    assert set(ENGINE_KINDS) == set(ENGINES)


@pytest.mark.parametrize("kind", ["vllm", "", None, "Embedded"])
def test_factory_rejects_an_unknown_kind(kind):
    with pytest.raises(ValueError, match=r"rollout\.engine: .* is not one of embedded, sglang"):
        engine_class(kind)


def test_build_engine_embedded(engine):
    path, _ = engine
    cfg = job_config_from_dict({"actor": {"load_hf": path}, "rollout": {"engine": "embedded", "dtype": "float32"},
                                "trainer": {"seed": 5}})
    built, server = build_engine(cfg)
    assert type(built) is EmbeddedEngine and server is None and built.dtype_name == "float32"
    # seeded with trainer.seed: its first unseeded call draws what an engine built by hand with that seed draws
    assert _samples(built.generate(PROMPTS, SP, n=2)) == \
        _samples(EmbeddedEngine(path, dtype="float32", seed=5).generate(PROMPTS, SP, n=2))


def _weight_sync_errors(kind, mode, sync):
    rollout = {"engine": kind, "mode": mode, "weight_sync": sync}
    if kind == "sglang":
        rollout["sglang_urls"] = ["http://127.0.0.1:9"]
    cfg = job_config_from_dict({"rollout": rollout})
    return [e for e in job_errors(cfg, world_size=1) if e.startswith("rollout.weight_sync:")]


@pytest.mark.parametrize("kind, mode", sorted(ACCEPTED))
def test_declared_modes_are_what_validation_accepts(kind, mode):
    cls = engine_class(kind)
    caps = cls.sync_capabilities
    default = caps.default(async_rollouts=mode == "async")
    assert default == AUTO[kind, mode]
    assert default in caps.modes and (mode == "sync" or default in caps.deferred)
    assert _weight_sync_errors(kind, mode, "auto") == [] and _weight_sync_errors(kind, mode, default) == []
    for sync in WEIGHT_SYNC_MODES:
        errs = _weight_sync_errors(kind, mode, sync)
        assert (errs == []) == (sync in ACCEPTED[kind, mode]), (sync, errs)
    accepted = {m for m in caps.modes if mode == "sync" or m in caps.deferred}
    assert accepted == ACCEPTED[kind, mode]


@pytest.mark.parametrize("kwargs", [dict(modes=("disk", "rdma")), dict(modes=("disk",), deferred=("tensor",)),
                                    dict(modes=("disk",), default_sync="tensor"),
                                    dict(modes=("disk", "tensor"), deferred=("disk",), default_async="tensor")])
def test_an_inconsistent_capability_declaration_is_refused(kwargs):
    """An engine class cannot declare an ``auto`` default it does not accept (or a deferred mode it cannot receive)."""
    from megatron_rl.weight_sync.endpoint import SyncCapabilities

    with pytest.raises(ValueError, match="SyncCapabilities: inconsistent"):
        SyncCapabilities(**kwargs)
