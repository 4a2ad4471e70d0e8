"""``megatron_rl.actor.main_params`` on plain torch modules (megatron's optimizers: the actor tests in
``tests/integration/test_actor_optimizer_resume.py``).

* The fp32 values a load wrote are kept exactly (reference: the source tensors), the parameters are their bf16
  rounding, and the kept copy lives in host memory (on a GPU: the device holds no fp32 copy after the load).
* No copy at all for a source whose weights are all bf16 (header dtypes of the safetensors files) or when not kept
  (the KL reference); an fp16 or fp32 source keeps one.
"""
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.actor.main_params import load_keeping_fp32, needs_fp32_copy


def _module(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).to(device=device, dtype=torch.bfloat16)


def _source(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(4, 8, generator=g), "bias": torch.randn(4, generator=g)}


def _loader(module, sd):
    def load():
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(sd[name].to(p.device))
    return load


def _write(tmp_path, sd, dtype):
    d = tmp_path / str(dtype).replace("torch.", "")
    os.makedirs(d, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    return str(d)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the device-memory half needs a GPU"))])
def test_the_loaded_fp32_values_are_kept_exactly_in_host_memory(device):
    m, src = _module(device), _source()
    before = torch.cuda.memory_allocated() if device == "cuda" else 0
    kept = load_keeping_fp32([m], _loader(m, src))
    names = {id(p): n for n, p in m.named_parameters()}
    assert sorted(names[k] for k in kept) == ["bias", "weight"]
    for k, t in kept.items():
        n = names[k]
        assert t.device.type == "cpu" and t.dtype == torch.float32, (n, t.device)
        assert torch.equal(t, src[n]), n
        p = dict(m.named_parameters())[n]
        assert p.dtype == torch.bfloat16 and p.device.type == device and torch.equal(p.cpu(), src[n].bfloat16())
    if device == "cuda":
        assert torch.cuda.memory_allocated() == before  # the bf16 weights only, as before the load


def test_a_bf16_source_holds_no_fp32_copy(tmp_path):
    src = _source()
    d = _write(tmp_path, src, torch.bfloat16)
    assert not needs_fp32_copy(d)
    m = _module()
    assert load_keeping_fp32([m], _loader(m, src), d) == {}
    assert torch.equal(m.weight.detach(), src["weight"].bfloat16())  # (the load itself ran)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_source_bf16_cannot_hold_keeps_its_copy(tmp_path, dtype):
    src = {k: v.to(dtype).float() for k, v in _source().items()}
    d = _write(tmp_path, src, dtype)
    assert needs_fp32_copy(d)
    m = _module()
    kept = load_keeping_fp32([m], _loader(m, src), d)
    assert len(kept) == 2 and torch.equal(kept[id(m.weight)], src["weight"])
    assert not torch.equal(src["weight"].bfloat16().float(), src["weight"])  # (bf16 loses bits of this source)


def test_an_actor_that_is_never_trained_keeps_no_copy():
    m, src = _module(), _source()
    assert load_keeping_fp32([m], _loader(m, src), keep=False) == {}
    assert torch.equal(m.bias.detach(), src["bias"].bfloat16())
