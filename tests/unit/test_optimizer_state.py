"""``megatron_rl.actor.optimizer_state`` on synthetic state dicts shaped as megatron-core loads them.

* Adam's step across an optimizer switch: torch's AdamW keeps it per parameter (megatron saves it as
  ``common_step``), Transformer Engine / apex FusedAdam keep it in each param group (``group["step"]``, no
  ``common_step``). Whichever the checkpoint holds, the converted state dict holds the same step in every param
  group (what FusedAdam and megatron's distributed optimizer read) and, for the non-distributed kinds, as
  ``common_step`` (what megatron hands torch's AdamW). Reference: the step written into the synthetic checkpoint.
* The refusal path: a main parameter the checkpoint holds in no fp32 form is reported by key (and the load
  refused by ``actor/checkpoint.py``), never redirected to a bf16 weight.
"""
import pytest
import torch

from megatron_rl.actor.optimizer_state import convert_loaded_state, redirect_main_params

GROUP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, wd_mult=1.0, lr_mult=1.0,
             is_expert_parallel=False, is_decoupled_lr=False, max_lr=1e-3, min_lr=0.0)


def _groups(step, params=((0, 1), (2,))):
    """Two param groups (``params``: this run's ids, None for a distributed optimizer's saved groups)."""
    out = []
    for i, p in enumerate(params):
        g = dict(GROUP, wd_mult=float(i))
        if p is not None:
            g["params"] = list(p)
        if step is not None:
            g["step"] = step
        out.append(g)
    return out


def _saved(kind, group_step=None, common_step=None):
    """A loaded optimizer state dict of ``kind`` (before conversion)."""
    state = {} if common_step is None else {"common_step": torch.tensor(float(common_step))}
    if kind == "fp32":
        return {"param_groups": _groups(group_step), "state": state}
    if kind == "mixed":
        return {"optimizer": {"param_groups": _groups(group_step), "state": state}, "fp32_from_fp16_params": [[]]}
    return {"optimizer": {"param_groups": _groups(group_step)}, "param_state": {}, "param_state_sharding_type": "x"}


def _requested(now):
    """The loading optimizer's param ids, where megatron puts them in the loaded state dict."""
    if now == "fp32":
        return {"param_groups": _groups(None)}
    return {"optimizer": {"param_groups": _groups(None)}}


def _load_as(saved, now, sd):
    """What the loading optimizer of kind ``now`` sees: the checkpoint's groups with this run's param ids."""
    if now == "fp32" and saved != "fp32":
        sd["param_groups"] = _requested(now)["param_groups"]
    elif now != "fp32" and saved == "fp32":
        sd["optimizer"] = _requested(now)["optimizer"]
    return sd


def _step_view(sd, now):
    """(every group's step, common_step or None) of a converted state dict of kind ``now``."""
    inner = sd if now == "fp32" else sd["optimizer"]
    common = (inner.get("state") or {}).get("common_step")
    return [g.get("step") for g in inner["param_groups"]], None if common is None else float(common)


PAIRS = [(s, n) for s in ("distributed", "mixed", "fp32") for n in ("distributed", "mixed", "fp32") if s != n]


@pytest.mark.parametrize("saved,now", PAIRS, ids=[f"{s}-to-{n}" for s, n in PAIRS])
def test_a_fused_adams_group_step_survives_the_switch(saved, now):
    """FusedAdam (TE / apex): the step lives only in the param groups; 7 in, 7 out, in every group."""
    sd = _load_as(saved, now, _saved(saved, group_step=7))
    convert_loaded_state(sd, saved, now)
    steps, common = _step_view(sd, now)
    assert steps == [7, 7], steps
    assert common == (None if now == "distributed" else 7.0)


@pytest.mark.parametrize("saved,now", [p for p in PAIRS if p[0] != "distributed"],
                         ids=[f"{s}-to-{n}" for s, n in PAIRS if s != "distributed"])
def test_torch_adams_common_step_survives_the_switch(saved, now):
    """torch's AdamW: megatron saved the step as common_step, no group step; 5 in, 5 out, in every group too."""
    sd = _load_as(saved, now, _saved(saved, common_step=5))
    convert_loaded_state(sd, saved, now)
    steps, common = _step_view(sd, now)
    assert steps == [5, 5], steps
    assert common == (None if now == "distributed" else 5.0)


def test_groups_at_different_steps_are_refused():
    sd = _saved("mixed")
    sd["optimizer"]["param_groups"][0]["step"], sd["optimizer"]["param_groups"][1]["step"] = 3, 4
    with pytest.raises(ValueError, match="different steps"):
        convert_loaded_state(sd, "mixed", "distributed")


def test_a_step_in_an_empty_group_is_not_the_optimizers():
    """FusedAdam does not step a group without parameters: its (stale) step is not the optimizer's."""
    sd = _saved("mixed", group_step=9)
    sd["optimizer"]["param_groups"][1]["params"] = []
    sd["optimizer"]["param_groups"][1]["step"] = 2
    convert_loaded_state(sd, "mixed", "distributed")
    assert [g["step"] for g in sd["optimizer"]["param_groups"]] == [9, 9]


class _Sharded:
    """What ``redirect_main_params`` reads of megatron's ShardedTensor: its ``key``."""

    def __init__(self, key):
        self.key = key


def _requested_sd(prefix=""):
    """A loading optimizer's sharded state dict: main parameters of two weights (mixed spelling) and moments."""
    return {"optimizer": {"state": {
        0: {"fp32_param": _Sharded(f"{prefix}optimizer.state.fp32_param.w0"),
            "exp_avg": _Sharded(f"{prefix}optimizer.state.exp_avg.w0")},
        1: [_Sharded(f"{prefix}optimizer.state.fp32_param.w1")]}}}


def _keys(sd):
    st = sd["optimizer"]["state"]
    return st[0]["fp32_param"].key, st[1][0].key


def test_a_main_parameter_only_a_bf16_weight_holds_is_reported_by_key():
    """A bf16 actor's checkpoint holding the weights but not the main parameters (in either spelling): both keys
    reported, nothing redirected to the bf16 weights."""
    sd = _requested_sd("chained_1.")
    saved = {"w0", "w1", "chained_1.optimizer.state.exp_avg.w0"}
    to_weights, missing = redirect_main_params(sd, saved, weights_are_fp32=False)
    assert to_weights == 0
    assert missing == ["chained_1.optimizer.state.fp32_param.w0", "chained_1.optimizer.state.fp32_param.w1"]
    assert _keys(sd) == tuple(missing)


def test_main_parameters_are_read_from_the_other_kind_or_an_fp32_weight():
    sd = _requested_sd()
    saved = {"optimizer.state.param.w0", "w1"}  # w0: the distributed optimizer's key; w1: an fp32 actor's weight
    assert redirect_main_params(sd, saved, weights_are_fp32=True) == (1, [])
    assert _keys(sd) == ("optimizer.state.param.w0", "w1")
    assert sd["optimizer"]["state"][0]["exp_avg"].key == "optimizer.state.exp_avg.w0"  # (moments untouched)


class _Sub:
    """A megatron sub-optimizer: its torch optimizer, or None where megatron built none."""

    def __init__(self, groups):
        self.optimizer = None if groups is None else type("T", (), {"param_groups": groups})()


def test_settings_pair_with_their_own_sub_optimizer_when_one_has_no_torch_optimizer():
    """megatron's chained state dict has one entry per sub-optimizer, also for one without a torch optimizer: the
    settings of the third sub-optimizer go to the third entry, not the second."""
    from megatron_rl.actor.optimizer_state import group_settings, impose_group_settings

    chained = type("C", (), {})()
    chained.chained_optimizers = [_Sub([dict(GROUP, params=[0], betas=(0.1, 0.2))]), _Sub(None),
                                  _Sub([dict(GROUP, params=[1], betas=(0.3, 0.4), is_expert_parallel=True)])]
    settings = group_settings(chained)
    loaded = {i: {"param_groups": [dict(GROUP, params=[i])]} for i in (0, 2)}
    loaded[1] = {"param_groups": []}
    loaded[2]["param_groups"][0]["is_expert_parallel"] = True
    impose_group_settings(loaded, "fp32", settings)
    assert loaded[0]["param_groups"][0]["betas"] == (0.1, 0.2)
    assert loaded[1]["param_groups"] == []
    assert loaded[2]["param_groups"][0]["betas"] == (0.3, 0.4)
