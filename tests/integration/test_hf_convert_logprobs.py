"""Proof that converted checkpoints are right: a Megatron GPTModel loaded from the converted shards gives
the same fp32 log-probs (full vocab log_softmax, <= 1e-4) as HF transformers on the original checkpoint.

Layouts: TP1, TP2, PP2, TP2xPP2 for Qwen2 and Llama (plus tied embeddings and vocab padding), EP2 (and
TP2xEP2 with ETP1 + sequence parallel) for Qwen3-MoE. The Megatron forward runs through megatron's own
pipeline schedule (``get_forward_backward_func(forward_only=True)``) on forked gloo ranks; the
vocab-parallel logits are all-gathered over TP in the test and padded vocab columns are dropped.

Run: ``pytest tests/integration/test_hf_convert_logprobs.py``.
"""
from __future__ import annotations

import functools

import pytest
import torch

import megatron.core  # noqa: F401  (import once in the parent: forked ranks start fast)
from megatron_rl.convert import ShardLayout, convert_hf_to_mcore, load_rank_state_dict, load_state_dict_into_model
from megatron_rl.convert.geometry import HFGeometry
from megatron_rl.convert.random_model import write_random_hf_model
from megatron_rl.testing.actor_reference import hf_model_config
from megatron_rl.testing.distributed import run_ranks

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 12, 2


def _rank_logits(rank, world, ckpt_dir, hf_dir, pcfg_kw, padded_vocab, tokens):
    """One rank: build the model for its coordinates, load its shard, forward through megatron's
    schedule; the last stage returns TP-gathered logits [b, s, padded_vocab]."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_rl.models import build_gpt_model
    from megatron_rl.parallel import ParallelConfig, initialize_model_parallel

    pcfg = ParallelConfig(**pcfg_kw)
    mcfg = hf_model_config(hf_dir, padded_vocab_size=padded_vocab)
    initialize_model_parallel(pcfg, seed=1)
    chunks = build_gpt_model(mcfg, pcfg)
    model = chunks[0]
    layout = ShardLayout(tensor_model_parallel_size=pcfg.tensor_model_parallel_size,
                         pipeline_model_parallel_size=pcfg.pipeline_model_parallel_size,
                         expert_model_parallel_size=pcfg.expert_model_parallel_size,
                         expert_tensor_parallel_size=pcfg.expert_tensor_parallel_size,
                         padded_vocab_size=padded_vocab)
    coords = dict(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                  ep_rank=ps.get_expert_model_parallel_rank(), etp_rank=ps.get_expert_tensor_parallel_rank())
    load_state_dict_into_model(model, load_rank_state_dict(ckpt_dir, layout, **coords), where=str(coords))
    model.eval()
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)

    def forward_step(data_iterator, m):
        out = m(next(data_iterator), pos, attention_mask=None)
        return out, lambda o: (torch.zeros(()), {"logits": o.detach()})

    with torch.no_grad():
        res = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model], num_microbatches=1,
            seq_length=s, micro_batch_size=b, forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    logits = res[0]["logits"]  # [b, s, V/TP]
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


@functools.lru_cache(maxsize=None)
def _hf_logprobs(hf_dir: str, tokens_key: bytes):
    tokens = torch.frombuffer(bytearray(tokens_key), dtype=torch.int64).view(BATCH, SEQ)
    m = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        logits = m(input_ids=tokens).logits.double()
    return torch.log_softmax(logits, dim=-1)


def _save_plain_hf(path, family, seed, **cfg):
    """A random fp32 HF model (architectures tiny_hf does not build)."""
    return write_random_hf_model(getattr(transformers, f"{family}Config")(**cfg), path, seed)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory, tiny_hf_model):
    root = tmp_path_factory.mktemp("tiny_lp")
    return {
        "qwen2": tiny_hf_model("qwen2", seed=1, num_hidden_layers=4),
        "llama": tiny_hf_model("llama", seed=2, num_hidden_layers=4),
        "qwen2_tied": tiny_hf_model("qwen2", seed=3, tie_word_embeddings=True),
        "qwen3_moe": tiny_hf_model("qwen3_moe", seed=4),
        "qwen3_moe_nonorm": tiny_hf_model("qwen3_moe", seed=5, norm_topk_prob=False),
        "qwen3": _save_plain_hf(root / "qwen3", "Qwen3", 6, vocab_size=250, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                tie_word_embeddings=True),
        "qwen2_moe": _save_plain_hf(root / "qwen2_moe", "Qwen2Moe", 7, vocab_size=300, hidden_size=64,
                                    intermediate_size=128, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1]),
    }


CASES = [
    # (model key, TP, PP, EP, ETP, sequence_parallel, make_vocab_size_divisible_by)
    ("qwen2", 1, 1, 1, None, False, 1),
    ("qwen2", 2, 1, 1, None, False, 1),
    ("qwen2", 1, 2, 1, None, False, 1),
    ("qwen2", 2, 2, 1, None, False, 1),
    ("llama", 1, 1, 1, None, False, 1),
    ("llama", 2, 1, 1, None, False, 1),
    ("llama", 1, 2, 1, None, False, 1),
    ("llama", 2, 2, 1, None, False, 128),   # padded vocab: 384 -> 512
    ("qwen2_tied", 1, 2, 1, None, False, 1),  # tied embeddings across pipeline stages
    ("qwen2_tied", 2, 1, 1, None, False, 100),  # tied + padded vocab (384 -> 400)
    ("qwen3_moe", 1, 1, 1, None, False, 1),
    ("qwen3_moe", 1, 1, 2, None, False, 1),
    ("qwen3_moe", 2, 1, 2, 1, True, 1),
    ("qwen3_moe_nonorm", 1, 2, 2, None, False, 1),
    ("qwen3", 2, 1, 1, None, False, 1),        # dense Qwen3: q/k norm, head_dim != hidden/heads, tied
    ("qwen2_moe", 1, 1, 2, None, False, 1),    # shared expert + sigmoid gate, dense layer via mlp_only_layers
    ("qwen2_moe", 2, 1, 1, None, True, 1),
]


@pytest.mark.parametrize("key,tp,pp,ep,etp,sp,div", CASES,
                         ids=[f"{c[0]}-tp{c[1]}-pp{c[2]}-ep{c[3]}" + (f"-etp{c[4]}" if c[4] else "")
                              + ("-sp" if c[5] else "") + (f"-vocabdiv{c[6]}" if c[6] > 1 else "") for c in CASES])
def test_megatron_logprobs_match_hf(tiny_models, tmp_path, key, tp, pp, ep, etp, sp, div):
    hf_dir = tiny_models[key]
    layout = ShardLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                         make_vocab_size_divisible_by=div)
    meta = convert_hf_to_mcore(hf_dir, str(tmp_path / "mcore"), layout)
    geom = HFGeometry.from_dict(meta["geometry"])
    padded = meta["padded_vocab_size"]
    assert padded % (div * tp) == 0 and padded >= geom.vocab_size
    world = tp * pp * max(1, ep * (etp or tp) // tp)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, geom.vocab_size, (BATCH, SEQ), generator=g)
    pcfg = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=etp, sequence_parallel=sp)
    outs = run_ranks(_rank_logits, world, str(tmp_path / "mcore"), hf_dir, pcfg, padded, tokens, timeout=120)
    last = [o for o in outs if o is not None]
    assert last, "no rank returned logits"
    ref = _hf_logprobs(hf_dir, tokens.numpy().tobytes())
    for logits in last:
        assert logits.shape == (BATCH, SEQ, padded)
        lp = torch.log_softmax(logits[..., : geom.vocab_size].double(), dim=-1)
        err = (lp - ref).abs().max().item()
        assert err <= 1e-4, f"max |log-prob diff| = {err:.3e} for {key} tp{tp} pp{pp} ep{ep}"
        # sanity: the check is not vacuous (log-probs vary a lot across the vocab)
        assert ref.std().item() > 1e-3
