"""Import-only stand-in for ``sgl_kernel`` on CPU (see ../README.md).

sglang (0.5.23) does ``from sgl_kernel import <name>_cpu`` at module load when running on CPU (9 names). The CPU
build of sgl-kernel is not published on PyPI and none of these ops is executed for dense text
generation with Qwen2/Llama, so each name is a function that raises if it is ever called.
"""

__version__ = "0.0.0+megatron-rl-cpu-standin"

#: The ``*_cpu`` op names sglang imports from ``sgl_kernel`` on CPU (9 at module load, 1 lazily);
#: tests/integration/test_sglang_cpu_standins.py checks this list against the installed sglang's source.
CPU_OP_NAMES = (
    "assign_req_to_token_pool_cpu",          # srt/mem_cache/allocation.py
    "copy_all_layer_kv_cache_cpu",           # kernels/ops/kvcache/cache_move.py
    "assign_draft_cache_locs_contiguous_cpu",  # kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",          # kernels/ops/speculative/cache_locs.py
    "fill_accept_out_cache_loc_cpu",         # kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",                 # kernels/ops/speculative/eagle.py
    "rotate_input_ids_cpu",                  # kernels/ops/speculative/multi_layer_eagle.py
    "build_tree_kernel_efficient_cpu",       # kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",                # kernels/ops/speculative/spec_tree.py
    "build_draft_decode_metadata_cpu",       # srt/layers/attention/intel_amx_backend.py (imported lazily)
)


def _standin(name):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but sgl_kernel here is megatron-rl's import-only CPU stand-in "
            "(megatron_rl/platform/sglang_cpu). Install a real CPU build of sgl-kernel for this feature.")

    op.__name__ = op.__qualname__ = name
    return op


for _name in CPU_OP_NAMES:
    globals()[_name] = _standin(_name)
del _name
