"""The activation formula of ``megatron_rl.ops.memory`` against megatron-core itself: the bytes one GPTModel
layer saves for backward, measured with ``torch.autograd.graph.saved_tensors_hooks`` (unique storages, parameters
excluded) on a tiny fp32 model on CPU (local layer spec, megatron-core 0.16.1), dense and MoE.

The CPU local path keeps a few tensors the GPU path (TE / fused kernels) does not; they are listed here one by one
and added to the formula, so the comparison is exact, byte for byte:
  * unfused SwiGLU: ``silu(gate)`` and ``silu(gate) * up`` besides the fc2 input (dense: 2 extra [s, b, f]);
    MoE experts multiply the routing probability inside the activation: 3 extra [n, f_moe];
  * composite RMSNorm (fp32 weight): the normalised copy, one [s, b, h] per norm, and rstd [s, b, 1] fp32;
  * RoPE cos / sin tables for Q and K: 4 x [s, 1, 1, d]; the causal mask [s, s] bool;
  * MoE routing metadata: top-k indices (int64) and probabilities (fp32) [s*b, k], their permuted copies [n],
    the routing map [E, s*b] bool.
Run: OMP_NUM_THREADS=1 pytest tests/integration/test_check_activation_measure.py
"""
import pytest
import torch

from megatron_rl.models.config import ModelConfig
from megatron_rl.ops.memory import layer_activation_bytes
from megatron_rl.platform.mcore_version import MCORE
from megatron_rl.testing.distributed import run_ranks

S, B = 128, 2
H, A, D, F = 256, 4, 64, 512
E, K, FM = 4, 2, 128


def _measure(rank, world, mc, s, b):
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.parallel.config import ParallelConfig
    from megatron_rl.parallel.state import destroy_model_parallel, initialize_model_parallel

    pc = ParallelConfig()
    initialize_model_parallel(pc, model=mc)
    try:
        (model,) = build_gpt_model(mc, pc, params_dtype=torch.float32)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        per_layer = []
        state = {}

        def pre(mod, args, kwargs):
            seen = {}
            per_layer.append(seen)

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in params:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            state["ctx"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            state["ctx"].__enter__()

        def post(mod, args, kwargs, out):
            state["ctx"].__exit__(None, None, None)

        for layer in model.decoder.layers:
            layer.register_forward_pre_hook(pre, with_kwargs=True)
            layer.register_forward_hook(post, with_kwargs=True)
        torch.manual_seed(0)
        ids = torch.randint(0, mc.vocab_size, (b, s))
        model(ids, torch.arange(s).unsqueeze(0).expand(b, s), None)
        return [sum(seen.values()) for seen in per_layer]
    finally:
        destroy_model_parallel()


def _cpu_extras_common(e=4):
    norm_copies = 2 * e * S * B * H          # composite RMSNorm's normalised copy, two norms
    rstd = 2 * 4 * S * B
    rope_tables = 4 * e * S * D              # cos, sin for Q and K
    causal_mask = S * S
    return norm_copies + rstd + rope_tables + causal_mask


@pytest.mark.timeout(300)
def test_dense_layer_matches_megatron_byte_for_byte():
    mc = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=A, kv_channels=D, vocab_size=256,
                     ffn_hidden_size=F)
    (measured,) = run_ranks(_measure, 1, mc, S, B, timeout=240)
    swiglu_extra = 2 * 4 * S * B * F
    for m in measured:
        assert m == layer_activation_bytes(mc, S, B, 1, False, 1, False, True, e=4) + swiglu_extra \
            + _cpu_extras_common()


@pytest.mark.timeout(300)
def test_moe_layer_matches_megatron_byte_for_byte():
    mc = ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=A, kv_channels=D, vocab_size=256,
                     ffn_hidden_size=F, num_moe_experts=E, moe_router_topk=K, moe_ffn_hidden_size=FM,
                     moe_router_load_balancing_type="none")
    (measured,) = run_ranks(_measure, 1, mc, S, B, timeout=240)
    n = S * B * K                                   # token-expert pairs (any routing: only the total matters)
    expert_act_extra = 3 * 4 * n * FM               # silu(gate), * up, * routing prob (fc2 input is counted)
    routing_meta = 8 * S * B * K + 4 * S * B * K + 8 * n + 4 * n + E * S * B
    if MCORE.moe_permute_saves_sort_index:          # its int64 sort index, not the [E, tokens] map and probs
        routing_meta += 8 * 2 * n - E * S * B - 4 * E * S * B
    for m in measured:
        assert m == layer_activation_bytes(mc, S, B, 1, False, 1, True, True, e=4) + expert_act_extra \
            + routing_meta + _cpu_extras_common()


def test_bf16_core_attention_terms():
    """bf16: softmax computed in fp32 (megatron's attention_softmax_in_fp32) -> 2 + 4 bytes per score."""
    mc = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=A, kv_channels=D, vocab_size=256,
                     ffn_hidden_size=F)
    none2 = layer_activation_bytes(mc, S, B, 1, False, 1, False, True, e=2)
    sel2 = layer_activation_bytes(mc, S, B, 1, False, 1, False, False, e=2)
    assert none2 - sel2 == (2 + 4) * A * S * S * B - 4 * A * S * B
    none4 = layer_activation_bytes(mc, S, B, 1, False, 1, False, True, e=4)
    sel4 = layer_activation_bytes(mc, S, B, 1, False, 1, False, False, e=4)
    assert none4 - sel4 == 4 * A * S * S * B - 4 * A * S * B
