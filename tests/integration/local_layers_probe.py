"""Worker of ``tests/integration/test_platform_select.py``, run in a fresh interpreter (patches are global):

    python tests/integration/local_layers_probe.py     # prints one JSON line

Applies only what a CPU lacks (``cpu_compat.apply_cpu_stand_ins``), then runs three paths of megatron's local
layer spec -- a packed (THD) forward, a multi-latent-attention model (build + packed forward), a
sequence-parallel torch norm -- and records how each fails. Then applies the patch sets ``select_patches``
gives a CUDA machine without Transformer Engine and runs them again: the packed forwards are compared with
each row run alone through megatron's ordinary (padded, causal) forward.
"""
import json

import torch

from megatron_rl.platform.cpu_compat import apply_cpu_stand_ins

apply_cpu_stand_ins()  # what a CPU lacks, and nothing else

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

import megatron_rl.models.builder as builder  # noqa: E402
from megatron_rl.models import ModelConfig  # noqa: E402
from megatron_rl.parallel import ParallelConfig  # noqa: E402
from megatron_rl.platform.select import Platform, apply_platform_patches  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

VOCAB = 64
ROWS = (5, 2, 7)
DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                    ffn_hidden_size=48, max_position_embeddings=64, init_method_std=0.2)
MLA = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, ffn_hidden_size=48,
                  max_position_embeddings=64, init_method_std=0.2, multi_latent_attention=True, q_lora_rank=24,
                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12)


def _attempt(fn):
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:  # the failure is the result
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _packed_vs_rows(mc):
    """Max |packed logits - each row alone| of a freshly built model (the packed forward is what may fail)."""
    (model,) = builder.build_gpt_model(mc, ParallelConfig())
    model.eval()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (n,), generator=g) for n in ROWS]
    cu = torch.tensor([0] + torch.tensor(ROWS).cumsum(0).tolist(), dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(ROWS),
                             max_seqlen_kv=max(ROWS))
    with torch.no_grad():
        packed = model(torch.cat(rows)[None], torch.cat([torch.arange(n) for n in ROWS])[None],
                       attention_mask=None, packed_seq_params=params)[0]
        alone = [model(r[None], torch.arange(len(r))[None], attention_mask=None)[0] for r in rows]
    return max((packed[a:b] - x).abs().max().item() for a, b, x in zip(cu.tolist(), cu.tolist()[1:], alone))


def _sp_norm():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
    norm = WrappedTorchNorm(cfg, 8, eps=1e-6)
    return [type(norm).__name__] + [getattr(p, "sequence_parallel", None) for p in norm.parameters()]


def _paths():
    return {"packed": _attempt(lambda: _packed_vs_rows(DENSE)), "mla": _attempt(lambda: _packed_vs_rows(MLA)),
            "sp_norm": _attempt(_sp_norm)}


def _rank(rank, world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=True)
    model_parallel_cuda_manual_seed(7)
    applied = builder.apply_platform_patches
    builder.apply_platform_patches = lambda *a, **k: ()  # the builder's own call would apply the set under test
    before = _paths()
    chosen = apply_platform_patches(Platform(has_cuda=True, has_te=False))
    builder.apply_platform_patches = applied
    return {"before": before, "chosen": list(chosen), "after": _paths()}


if __name__ == "__main__":
    (result,) = run_ranks(_rank, 1, timeout=240)
    print(json.dumps(result))
