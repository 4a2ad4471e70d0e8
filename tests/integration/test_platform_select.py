"""Patch selection keyed on what is missing (``platform.select``): without Transformer Engine the local-layer set,
without CUDA the CPU set as well; and the set a CUDA machine without TE gets is what megatron's local layers need.

The second claim runs ``local_layers_probe.py`` in a fresh interpreter: with only the CPU stand-ins applied, a
packed forward, a multi-latent-attention model and a sequence-parallel torch norm fail inside megatron with the
errors measured on a CUDA machine without TE ("Packed sequence is not supported by DotProductAttention",
"unexpected keyword argument 'k_channels'", "sequence parallel not supported"); after applying the sets
``select_patches(has_cuda=True, has_te=False)`` names, all three run and the packed forwards (dense GQA and
MLA) equal each row run alone through megatron's padded path.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_platform_select.py -q``
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.platform.select import PATCH_SETS, Platform, select_patches

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("has_cuda,has_te,expected", [
    (True, False, ("local_layers",)),      # CUDA without TE: megatron's local spec, real CUDA
    (False, False, ("cpu", "local_layers")),
    (False, True, ("cpu", "local_layers")),  # TE cannot run without CUDA: the local spec is built
    (True, True, ()),                       # TE's spec: nothing to patch
])
def test_selection_is_keyed_on_what_is_missing(has_cuda, has_te, expected):
    assert select_patches(has_cuda=has_cuda, has_te=has_te) == expected
    assert set(expected) <= set(PATCH_SETS)


def test_detect_on_this_machine():
    p = Platform.detect()
    assert p.has_cuda == torch.cuda.is_available()
    assert not (p.has_te and not p.has_cuda)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe runs megatron on CPU")
@pytest.mark.timeout(300)
def test_cuda_without_te_set_makes_packed_mla_and_sp_paths_run():
    r = subprocess.run([sys.executable, os.path.join(HERE, "local_layers_probe.py")], capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    assert not before["packed"]["ok"] and "Packed sequence is not supported" in before["packed"]["error"]
    assert not before["mla"]["ok"] and "k_channels" in before["mla"]["error"]
    assert not before["sp_norm"]["ok"] and "sequence parallel" in before["sp_norm"]["error"]
    assert out["chosen"] == ["local_layers"]
    for path in ("packed", "mla", "sp_norm"):
        assert after[path]["ok"], f"{path}: {after[path].get('error')}"
    assert after["packed"]["value"] < 1e-5 and after["mla"]["value"] < 1e-5
    assert after["sp_norm"]["value"] == ["RMSNorm", True]
