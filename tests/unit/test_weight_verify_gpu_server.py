"""Weight-sync verification against SGLang servers the trainer cannot hash like (found in review):

* SGLang's ``/weights_checker`` hashes CUDA tensors with its Triton ``gpu_tensor_hash`` and CPU tensors with
  sha256 (``sglang.srt.managers.mm_utils.tensor_hash``). A trainer that compared sha256 with a GPU server's
  Triton hashes failed every sync at step 0 on every shipped GPU config. Now: a GPU server without that kernel
  in the trainer's process is not verified (one warning, ``verified_param_frac`` 0), never failed.
* Tensors the SGLang layout does not know (DeepSeek's MLA projections, split by SGLang's own column-parallel
  linears) are left out of the layout instead of being expected whole on every TP rank.
* Which tensors are kept in fp32 is decided from the HF names: a sync that does not verify never calls
  ``/weights_checker``.
A CUDA SGLang server cannot run on this machine: the server's reply (``/get_server_info``) is the one thing
stood in for; the decision code is the real one.
"""
import pytest
import torch

from megatron_rl.config import job_config_from_dict
from megatron_rl.rollout.sglang_engine import SGLangEngine
from megatron_rl.weight_sync.buckets import tensor_checksum
from megatron_rl.weight_sync.layout import Replicated, sglang_layout
from megatron_rl.weight_sync import verify as weight_verify
from megatron_rl.trainer.sync_settings import weight_sync_settings


def _engine(device: str) -> SGLangEngine:
    eng = SGLangEngine.__new__(SGLangEngine)  # no server: only the reply of /get_server_info is needed
    eng.urls = ["http://gpu-node:30000"]
    eng._server_info = {eng.urls[0]: {"device": device, "tp_size": 8}}

    def no_checker(*a, **k):
        raise AssertionError("/weights_checker must not be called")
    eng._checker = no_checker
    return eng


def test_cpu_server_uses_sglangs_cpu_hash():
    """On a CPU server SGLang hashes sha256 of the contiguous bytes: the trainer reproduces it."""
    from hashlib import sha256
    eng = _engine("cpu")
    t = torch.randn(5, 3).t()  # non-contiguous, as a row-parallel shard is
    ref = sha256(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())).digest()[:8]
    assert eng.weight_holding([], verify=True).checksum(t) == f"{int.from_bytes(ref, 'big'):016x}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU with SGLang importable the Triton hash is used")
def test_gpu_server_is_not_verified_and_never_fails_the_sync(capsys):
    eng = _engine("cuda")
    assert eng.weight_holding([], verify=True).checksum is None
    job = job_config_from_dict({"rollout": {"engine": "sglang", "sglang_urls": eng.urls,
                                            "weight_sync_verify_tensors": -1}})
    weight_verify._UNVERIFIABLE_SAID.clear()
    v = weight_verify.verifier_for(None, eng, weight_sync_settings(job), ["model.norm.weight"], "step-0")
    assert v.tensors == [] and v.hash is None
    assert v.check("weight sync to 'step-0'", "the trainer's") == [] and v.verified_frac == 0.0
    out = capsys.readouterr().out
    assert "verification skipped" in out and out.count("WARNING") == 1
    weight_verify.verifier_for(None, eng, weight_sync_settings(job), ["model.norm.weight"], "step-1")
    assert "verification skipped" not in capsys.readouterr().out  # once per process


def test_fp32_kept_names_come_from_the_hf_names_without_the_checker():
    eng = _engine("cuda")
    names = ["model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias"]
    assert eng.weight_holding(names).full_precision == {"model.layers.3.mlp.gate.e_score_correction_bias"}


def test_unknown_tensors_are_left_out_not_assumed_replicated():
    """SGLang's DeepseekV2AttentionMLA holds q_b_proj / kv_b_proj as ColumnParallelLinear (split over TP
    ranks): expecting them whole failed any TP>1 sync that sampled one."""
    pre = "model.layers.0."
    names = [pre + n for n in ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                               "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                               "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight",
                               "self_attn.o_proj.weight", "input_layernorm.weight",
                               "mlp.gate.weight", "mlp.gate.e_score_correction_bias")]
    layout = {t.name: t for t in sglang_layout(names, 1)}
    for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert pre + f"self_attn.{n}.weight" not in layout
    for n in ("self_attn.q_a_layernorm.weight", "self_attn.kv_a_layernorm.weight", "input_layernorm.weight",
              "mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
        assert isinstance(layout[pre + n].pieces[0].shard, Replicated)
    assert pre + "self_attn.o_proj.weight" in layout
    assert tensor_checksum(torch.zeros(2)) == _engine("cpu").weight_holding([], verify=True).checksum(torch.zeros(2))


def test_fp32_kept_bias_is_compared_in_fp32_as_sglang_holds_it():
    """Stand-in for a real DeepSeek-V3 SGLang server (the CPU backend cannot serve MLA, docs/limits.md): SGLang's
    MoEGate keeps ``e_score_correction_bias`` fp32 in a bf16 model and its checker hashes those fp32 bytes
    (sha256 on CPU). The verifier, given the names ``weight_holding(...).full_precision`` picks, expects exactly that;
    cast to bf16 (the old behaviour) the same sync would be reported as corrupted."""
    from hashlib import sha256
    from dataclasses import replace
    from types import SimpleNamespace

    from megatron_rl.weight_sync.verify import WeightVerifier

    bias_name = "model.layers.3.mlp.gate.e_score_correction_bias"
    bias = torch.randn(16, dtype=torch.float32) * 1e-3  # values bf16 cannot hold exactly
    eng = _engine("cpu")
    sglang_hash = f"{int.from_bytes(sha256(memoryview(bias.view(torch.uint8).numpy())).digest()[:8], 'big'):016x}"
    eng._checker_names = lambda: {bias_name}
    eng._info = lambda url: {"device": "cpu", "ep_size": 1}
    eng.weight_checksums = lambda names: {eng.urls[0]: {bias_name: (sglang_hash,)}}
    geometry = SimpleNamespace(num_query_groups=1)
    holding = eng.weight_holding([bias_name], geometry, verify=True)
    keep = holding.full_precision
    for kept, ok in ((keep, True), (set(), False)):
        v = WeightVerifier(eng, [bias_name], replace(holding, dtype=torch.bfloat16, full_precision=kept), -1, 0)
        v.offer(bias_name, bias)
        if ok:
            assert v.check("sync", "the trainer's") == [bias_name] and v.verified_frac == 1.0
        else:
            with pytest.raises(Exception, match="e_score_correction_bias"):
                v.check("sync", "the trainer's")
