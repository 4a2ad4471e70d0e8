"""``weight_sync.modes.resolve_mode``: the one reader of ``rollout.weight_sync`` resolves ``auto`` and names the
key's problems. Stand-in engine classes declare capabilities the real engines do not (a mode that cannot be
deferred), so every refusal is reached; the expected texts are the user-facing messages of the config checks."""
from types import SimpleNamespace

import pytest

from megatron_rl.weight_sync.endpoint import SyncCapabilities
from megatron_rl.weight_sync.modes import DiskMode, DistributedMode, TensorMode, resolve_mode


class _Small:
    sync_capabilities = SyncCapabilities(modes=("disk", "tensor"), deferred=("disk",), default_sync="tensor",
                                         default_async="disk")


class _Wide:
    sync_capabilities = SyncCapabilities(modes=("disk", "tensor", "distributed"),
                                         deferred=("disk", "tensor", "distributed"), default_sync="distributed",
                                         default_async="tensor")


ENGINES = {"small": _Small, "wide": _Wide}


def _r(weight_sync, engine="small", mode="sync", master=None):
    return SimpleNamespace(weight_sync=weight_sync, engine=engine, mode=mode, weight_sync_master_address=master)


@pytest.mark.parametrize("engine, mode, want", [("small", "sync", TensorMode), ("small", "async", DiskMode),
                                                ("wide", "sync", DistributedMode), ("wide", "async", TensorMode)])
def test_auto_is_the_engine_classes_default_and_says_so(engine, mode, want):
    got = resolve_mode(_r("auto", engine, mode), ENGINES)
    assert type(got) is want and got.auto is True
    explicit = resolve_mode(_r(want.name, engine, mode), ENGINES)
    assert type(explicit) is want and explicit.auto is False


def test_distributed_carries_the_master_address():
    got = resolve_mode(_r("distributed", "wide", master="10.0.0.7"), ENGINES)
    assert got.master_address == "10.0.0.7" and got.name == "distributed" and got.streamed


def test_only_tensor_carries_delta():
    assert [m.delta_ok for m in (DiskMode(), TensorMode(), DistributedMode())] == [False, True, False]


def test_problems_name_the_key():
    with pytest.raises(ValueError) as e:
        resolve_mode(_r("nccl"), ENGINES)
    assert str(e.value) == "rollout.weight_sync: 'nccl' is not one of auto, disk, tensor, distributed"
    with pytest.raises(ValueError) as e:
        resolve_mode(_r("distributed", "small"), ENGINES)
    assert str(e.value) == ("rollout.weight_sync: 'distributed' needs rollout.engine 'wide' (the small engine takes "
                            "disk or tensor)")
    with pytest.raises(ValueError) as e:
        resolve_mode(_r("tensor", "small", "async"), ENGINES)
    assert str(e.value) == ("rollout.weight_sync: 'tensor' streams the weights from every trainer rank at sync time, "
                            "but rollout.mode 'async' applies them later in rank 0's producer thread alone — use "
                            "rollout.weight_sync: disk (or auto) with rollout.mode: async")


def test_an_unknown_engine_resolves_nothing_but_a_bad_value_is_still_named():
    assert resolve_mode(_r("auto", "vllm"), ENGINES) is None
    assert resolve_mode(_r("tensor", "vllm"), ENGINES) is None
    with pytest.raises(ValueError, match="rollout.weight_sync: 'x' is not one of"):
        resolve_mode(_r("x", "vllm"), ENGINES)
