"""Adapter-only sync's SGLang side without a server (the real server: ``test_lora_sync_sglang.py``): the PEFT
directory each version writes is read back by PEFT itself with the sender's scaling; every server loads the new
adapter before any unloads the old one; a server that refuses the load leaves the previous adapter served and the
servers that loaded it unload it again; the probe is compared per server, naming the one that differs."""
from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.weight_sync.adapter_sync import AdapterPayload
from megatron_rl.weight_sync.endpoint import WeightSyncError
from megatron_rl.weight_sync.receivers.sglang_lora import SGLangAdapters, write_adapter_dir

P = "base_model.model.model.layers.0."


def _tensors(rank=4):
    g = torch.Generator().manual_seed(0)
    return {P + "self_attn.q_proj.lora_A.weight": torch.randn(rank, 8, generator=g),
            P + "self_attn.q_proj.lora_B.weight": torch.randn(8, rank, generator=g),
            P + "mlp.down_proj.lora_A.weight": torch.randn(rank, 16, generator=g),
            P + "mlp.down_proj.lora_B.weight": torch.randn(8, rank, generator=g)}


def test_directory_is_a_peft_adapter_with_the_senders_scaling(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    path = write_adapter_dir(str(tmp_path), _tensors(), 2.5, "step-3")
    assert os.path.basename(path) == "step-3"
    cfg = peft.LoraConfig.from_pretrained(path)
    assert cfg.r == 4 and cfg.lora_alpha / cfg.r == 2.5
    assert set(cfg.target_modules) == {"q_proj", "down_proj"}
    got = load_file(os.path.join(path, "adapter_model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in _tensors().items()) and set(got) == set(_tensors())


class _Servers:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def __call__(self, url, path, body):
        self.calls.append((url, path, body["lora_name"]))
        if (url, path, body["lora_name"]) in self.refuse:
            raise WeightSyncError(f"{url}{path} refused")
        return {"success": True}


def test_load_everywhere_before_unloading_the_previous(tmp_path):
    urls = ["http://a", "http://b"]
    ad, post = SGLangAdapters(str(tmp_path)), _Servers(refuse={("http://a", "/unload_lora_adapter", "step-1"),
                                                                ("http://b", "/unload_lora_adapter", "step-1")})
    ad.load(urls, post, _tensors(), 2.0, "step-1")  # first load: the name is freed first (nothing there: refused)
    assert [c for c in post.calls if c[1] == "/load_lora_adapter"] == [(u, "/load_lora_adapter", "step-1")
                                                                         for u in urls]
    post.calls.clear()
    post.refuse.clear()
    ad.load(urls, post, _tensors(), 2.0, "step-2")
    assert post.calls == [("http://a", "/load_lora_adapter", "step-2"), ("http://b", "/load_lora_adapter", "step-2"),
                          ("http://a", "/unload_lora_adapter", "step-1"), ("http://b", "/unload_lora_adapter", "step-1")]
    assert ad.name == "step-2" and sorted(os.listdir(tmp_path)) == ["step-2"]


def test_a_refused_load_keeps_the_previous_adapter(tmp_path):
    urls = ["http://a", "http://b"]
    ad = SGLangAdapters(str(tmp_path))
    ad.load(urls, _Servers(), _tensors(), 2.0, "step-1")
    post = _Servers(refuse={("http://b", "/load_lora_adapter", "step-2")})
    with pytest.raises(WeightSyncError, match="http://b/load_lora_adapter refused"):
        ad.load(urls, post, _tensors(), 2.0, "step-2")
    assert post.calls[-1] == ("http://a", "/unload_lora_adapter", "step-2")  # a unloads what it loaded
    assert ad.name == "step-1" and sorted(os.listdir(tmp_path)) == ["step-1"]


class _Engine:
    weight_dtype = torch.bfloat16

    def __init__(self, by_server):
        self.by_server, self.invalid = by_server, None

    def load_lora_adapter(self, tensors, scale, version):
        pass

    def token_log_probs_by_server(self, probe):
        return self.by_server

    def invalidate_weights(self, reason):
        self.invalid = reason


def test_probe_is_compared_per_server():
    trainer = -torch.rand(2, 3)
    ok = _Engine({"http://a": trainer.tolist(), "http://b": (trainer + 0.05).tolist()})
    payload = AdapterPayload(_tensors(), 2.0, [[1, 2, 3, 4]] * 2, trainer)
    assert payload.apply(ok, None, "step-1").verified
    bad = _Engine({"http://a": trainer.tolist(), "http://b": (trainer + 0.5).tolist()})
    with pytest.raises(WeightSyncError, match="http://b: the log-probs of the probe differ"):
        payload.apply(bad, None, "step-1")
    assert bad.invalid is not None
