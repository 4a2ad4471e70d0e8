"""``actor.optimizer_chain``: a requested optimizer tensor saved only under another ``chained_<i>.`` prefix is
refused naming both keys and both expert-parallel sizes; keys present as requested (a pipeline stage with one
optimizer next to one with two) and other spellings (another optimizer kind) are not."""
from types import SimpleNamespace

from megatron_rl.actor.optimizer_chain import chain_problem, requested_keys

W = "decoder.layers.0.self_attention.linear_qkv.weight"
E = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"


def test_another_chaining_is_refused_naming_the_keys():
    saved = [W, f"chained_0.optimizer.state.exp_avg.{W}", f"chained_1.optimizer.state.exp_avg.{E}"]
    req = {"optimizer": {"state": [SimpleNamespace(key=f"optimizer.state.exp_avg.{W}")]}}
    msg = chain_problem(requested_keys(req), saved, 2, 1)
    assert f"'chained_0.optimizer.state.exp_avg.{W}'" in msg and f"'optimizer.state.exp_avg.{W}'" in msg
    assert "expert_model_parallel_size saved 2, now 1" in msg
    back = chain_problem([f"chained_1.optimizer.state.exp_avg.{E}"], [f"optimizer.state.exp_avg.{E}"], 1, 2)
    assert "saved 1, now 2" in back


def test_same_chaining_per_stage_and_other_kinds_pass():
    # stage 0 (dense layers only) saved by one optimizer, stage 1 by two: each stage asks for what it saved
    saved = [f"optimizer.state.exp_avg.{W}", f"chained_1.optimizer.state.exp_avg.{E}"]
    assert chain_problem([f"optimizer.state.exp_avg.{W}"], saved, 2, 2) is None
    assert chain_problem([f"chained_1.optimizer.state.exp_avg.{E}"], saved, 2, 2) is None
    # another optimizer kind (main parameter spelled otherwise): left to the kind conversion
    assert chain_problem([f"chained_0.optimizer.state.fp32_param.{W}"], [f"optimizer.state.param.{W}"], 1, 2) is None
