"""``ParallelDims``: its sizes equal the groups megatron-core builds, and every invalid layout names its keys.

The reference is megatron-core itself: on forked gloo ranks, ``initialize_model_parallel`` builds megatron's
groups and each size is read back as the size of the group megatron made (``dist.get_world_size(group)``).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_parallel_dims.py -q``
"""
import pytest

from megatron_rl.platform.select import apply_cpu_patches

apply_cpu_patches()  # imports megatron in the parent: forked ranks start in ~0.3 s

from megatron_rl.models import ModelConfig  # noqa: E402
from megatron_rl.parallel import (ActorGroups, ParallelConfig, ParallelConfigError, ParallelDims,  # noqa: E402
                                  destroy_model_parallel, initialize_model_parallel)
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

DENSE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=128,
             ffn_hidden_size=128)
MOE = dict(DENSE, num_moe_experts=8, moe_ffn_hidden_size=32)


def _megatron_sizes_body(rank, world, cfg, model):
    """On one rank: ParallelDims built from the config, the dims ``initialize_model_parallel`` returns, those
    ``ActorGroups`` reads back, and the sizes of the groups megatron actually built."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.convert.partition import RankCoords

    built = ParallelDims.build(cfg, world, model)
    returned = initialize_model_parallel(cfg, seed=3, model=model)
    groups = ActorGroups.from_parallel_state(sequence_parallel=cfg.sequence_parallel)

    def size(group):
        return dist.get_world_size(group=group)

    megatron = {"tp": size(ps.get_tensor_model_parallel_group()), "pp": size(ps.get_pipeline_model_parallel_group()),
                "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
                "cp": size(ps.get_context_parallel_group()), "ep": size(ps.get_expert_model_parallel_group()),
                "etp": size(ps.get_expert_tensor_parallel_group()),
                "dp": size(ps.get_data_parallel_group(with_context_parallel=False)),
                "edp": size(ps.get_expert_data_parallel_group()), "world_size": dist.get_world_size()}
    coords = RankCoords.from_groups(groups)
    destroy_model_parallel()
    return built, returned, groups.dims, megatron, coords


# (config, world, model, seq_multiple): seq_multiple is megatron's own rule for each layout, written out by hand
# (SP: sequence split over TP; CP: 2 x CP zigzag halves)
LAYOUTS = [
    pytest.param(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4, DENSE, 1,
                 id="tp2xpp2"),
    pytest.param(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True),
                 4, MOE, 2, id="tp2xep2-sp"),
    pytest.param(ParallelConfig(context_parallel_size=2), 4, DENSE, 4, id="cp2"),
    pytest.param(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                expert_tensor_parallel_size=1, sequence_parallel=True), 4, MOE, 2, id="etp1-tp2"),
    pytest.param(ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), 4, None, 1,
                 id="pp4xvpp2"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cfg,world,model,seq_multiple", LAYOUTS)
def test_sizes_equal_megatron_groups(cfg, world, model, seq_multiple):
    mc = ModelConfig(**model) if model is not None else None
    for rank, (built, returned, read_back, megatron, coords) in enumerate(
            run_ranks(_megatron_sizes_body, world, cfg, mc, timeout=100)):
        ours = {k: getattr(built, k) for k in megatron}
        assert ours == megatron, f"rank {rank}: ParallelDims {ours} != megatron's groups {megatron}"
        assert returned == built and read_back == built, (rank, returned, read_back, built)
        assert built.sequence_parallel == cfg.sequence_parallel and built.seq_multiple == seq_multiple
        assert (coords.tp_size, coords.pp_size, coords.vpp_size, coords.ep_size, coords.etp_size) == (
            megatron["tp"], megatron["pp"], megatron["vpp"], megatron["ep"], megatron["etp"])


def _sp_without_tp_body(rank, world):
    initialize_model_parallel(ParallelConfig(), seed=3)
    dims = ActorGroups.from_parallel_state(sequence_parallel=True).dims
    destroy_model_parallel()
    return dims


@pytest.mark.timeout(60)
def test_sequence_parallel_counts_only_with_tp():
    # megatron ignores sequence parallel at TP 1: so do the groups read from its state
    for dims in run_ranks(_sp_without_tp_body, 2, timeout=45):
        assert dims.sequence_parallel is False and dims.seq_multiple == 1 and dims.dp == 2


def test_describe_names_each_used_size():
    dims = ParallelDims.build(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=1, sequence_parallel=True), 8,
                              ModelConfig(**MOE))
    assert dims.describe() == "TP=2 PP=1 CP=1 DP=4 EP=2 ETP=1"
    assert ParallelDims.build(ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2),
                              8).describe() == "TP=1 PP=4 VPP=2 CP=1 DP=2"


@pytest.mark.parametrize("cfg,world,model,keys", [
    (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2), 12, None,
     ["world_size=12", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"]),
    (ParallelConfig(expert_model_parallel_size=4, expert_tensor_parallel_size=2), 4, MOE,
     ["world_size=4", "expert_tensor_parallel_size", "expert_model_parallel_size", "pipeline_model_parallel_size"]),
    (ParallelConfig(sequence_parallel=True), 2, None, ["sequence_parallel", "tensor_model_parallel_size"]),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2, None,
     ["virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size"]),
    (ParallelConfig(expert_model_parallel_size=3), 3, MOE, ["num_moe_experts=8", "expert_model_parallel_size=3"]),
    (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2), 4, MOE,
     ["tensor_model_parallel_size=2", "sequence_parallel"]),
    (ParallelConfig(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=5), 2, DENSE,
     ["parallel.num_layers_in_first_pipeline_stage", "model.num_layers=4", "pipeline_model_parallel_size=2"]),
    (ParallelConfig(tensor_model_parallel_size=0), 2, None, ["tensor_model_parallel_size=0"]),
])
def test_invalid_layout_names_its_keys(cfg, world, model, keys):
    with pytest.raises(ParallelConfigError) as exc:
        ParallelDims.build(cfg, world, ModelConfig(**model) if model is not None else None)
    msg = "\n".join(exc.value.violations)
    for k in keys:
        assert k in msg, f"{k!r} not in {msg!r}"


def test_every_violation_in_one_error():
    # the world, the layers over the pipeline and the heads over TP: three rules, one error
    with pytest.raises(ParallelConfigError) as exc:
        ParallelDims.build(ParallelConfig(tensor_model_parallel_size=3, pipeline_model_parallel_size=3), 8,
                           ModelConfig(**DENSE))
    msg = "\n".join(exc.value.violations)
    for k in ("world_size=8", "num_layers=4", "num_attention_heads=8"):
        assert k in msg
