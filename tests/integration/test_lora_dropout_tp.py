"""LoRA dropout at TP2: where the TP ranks hold DIFFERENT parts of the adapter's input (a row-parallel layer's input
columns, a column-parallel layer's sequence chunk under SP) each rank draws its own mask -- megatron's
tensor-parallel RNG, as megatron's own dropout in TP regions -- so the mask over the whole input is not one block
repeated TP times; where they hold the SAME input (column-parallel without SP) the masks are equal (or the
replicated A would get different gradients on the TP ranks).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_lora_dropout_tp.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401  (imported once in the parent: forked ranks start fast)
from megatron_rl.testing.distributed import run_ranks

H = 64


def _masks(rank, world):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    from megatron_rl.lora.layers import COLUMN, ROW, lora_class
    from megatron_rl.parallel import initialize_model_parallel
    from megatron_rl.parallel.config import ParallelConfig

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=2), seed=7)
    out = {}
    for sp in (False, True):
        cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, use_cpu_initialization=True,
                                tensor_model_parallel_size=2, sequence_parallel=sp, params_dtype=torch.float32)
        for name, cls, kind in (("row", RowParallelLinear, ROW), ("column", ColumnParallelLinear, COLUMN)):
            kw = {"input_is_parallel": True} if kind == ROW else {"gather_output": False}
            m = cls(H, H, config=cfg, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=True, **kw)
            m.__class__ = lora_class(cls, kind)
            m.attach(2, 1.0, 0.5, torch.zeros(2, H), rank)
            m.train()
            x = torch.ones(16, 1, H // 2 if kind == ROW else H)
            out[(name, sp)] = m._lora_dropout_input(x, {"sequence_parallel": sp and kind == COLUMN}) != 0
    return out


@pytest.mark.timeout(120)
def test_dropout_masks_follow_the_input_split():
    r0, r1 = run_ranks(_masks, 2, timeout=100)
    assert not torch.equal(r0[("row", False)], r1[("row", False)])   # different input columns: own masks
    assert not torch.equal(r0[("column", True)], r1[("column", True)])  # SP: different sequence chunks
    assert torch.equal(r0[("column", False)], r1[("column", False)])  # the same replicated input: one mask
    for m in list(r0.values()) + list(r1.values()):
        assert 0.2 < m.float().mean() < 0.8  # dropout p=0.5 did drop
