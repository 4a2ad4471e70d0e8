"""``actor.recompute_*`` validation (models/recompute.py) against megatron-core's own TransformerConfig checks: every
setting megatron-core refuses is refused by name before anything is built; the stricter rule (a key without
effect at the chosen granularity) is refused too."""
import pytest
import torch

from megatron_rl.models.recompute import Recompute


def _megatron_refuses(r: Recompute) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
                          **r.transformer_config_kwargs())
    except (ValueError, AssertionError):
        return True
    return False


@pytest.mark.parametrize("r", [
    Recompute("full"), Recompute("full", "uniform"), Recompute("full", "diagonal", 1),
    Recompute("selective", num_layers=1), Recompute("selective", modules=("core_attn", "attention")),
    Recompute("selective", modules=("moe_act",)), Recompute("partial"),
])
def test_what_megatron_refuses_is_refused_by_name(r):
    errs = r.errors(stage_layers=[4])
    assert errs and all(e.startswith("actor.recompute_") for e in errs), errs
    if r.granularity != "partial":  # megatron-core only reaches it through its own Literal type
        assert _megatron_refuses(r)


@pytest.mark.parametrize("r", [Recompute(), Recompute("full", "uniform", 1), Recompute("full", "block", 4),
                               Recompute("selective"), Recompute("selective", modules=("core_attn", "mlp"))])
def test_what_megatron_accepts_is_accepted(r):
    assert r.errors(stage_layers=[4]) == []
    assert not _megatron_refuses(r)


@pytest.mark.parametrize("r,key", [(Recompute(None, "uniform"), "recompute_method"),
                                   (Recompute("selective", "uniform"), "recompute_method"),
                                   (Recompute(None, modules=("core_attn",)), "recompute_modules"),
                                   (Recompute("full", "block", 5), "recompute_num_layers")])
def test_settings_without_effect_are_refused(r, key):
    errs = r.errors(stage_layers=[4])
    assert any(e.startswith(f"actor.{key}:") for e in errs), errs
