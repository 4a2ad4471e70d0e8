"""Parallel setup: Slurm nodelist parser, launcher env resolution, layout validation, megatron groups.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_parallel.py -q``
"""
import itertools

import pytest
import torch

from megatron_rl.platform.select import apply_cpu_patches

apply_cpu_patches()  # imports megatron in the parent: forked ranks start in ~0.3 s

from megatron_rl.models import ModelConfig  # noqa: E402
from megatron_rl.parallel import (ParallelConfig, ParallelConfigError, initialize_model_parallel,  # noqa: E402
                                  parallel_config_from_dict, parse_slurm_nodelist, resolve_launch_env,
                                  validate_parallel_config)
from megatron_rl.parallel.state import destroy_model_parallel  # noqa: E402
from megatron_rl.testing.distributed import run_ranks  # noqa: E402

# ----------------------------------------------------------------------------- nodelist parser


@pytest.mark.parametrize("nodelist,expected", [
    ("node01", ["node01"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),
    ("gpu-[098-101]", ["gpu-098", "gpu-099", "gpu-100", "gpu-101"]),
    ("r[1-2]n[1,3]", ["r1n1", "r1n3", "r2n1", "r2n3"]),
    ("x1, x2", ["x1", "x2"]),
    ("c[5]", ["c5"]),
])
def test_parse_slurm_nodelist(nodelist, expected):
    assert parse_slurm_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad,fragment", [("", "empty"), ("node[01-03", "unbalanced"), ("node01]", "unbalanced"),
                                          ("n[3-1]", "descending"), ("n[a-b]", "bad range")])
def test_parse_slurm_nodelist_errors(bad, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_slurm_nodelist(bad)


# ----------------------------------------------------------------------------- launcher environment


def test_resolve_torchrun_env():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "1234"}
    e = resolve_launch_env(env)
    assert (e.launcher, e.rank, e.local_rank, e.world_size, e.master_addr, e.master_port) == \
        ("torchrun", 5, 1, 8, "10.0.0.2", 1234)


def test_resolve_slurm_env_uses_first_host_and_default_port():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16", "SLURM_NODELIST": "gpu[07-08],cpu1"}
    e = resolve_launch_env(env)
    assert (e.launcher, e.rank, e.local_rank, e.world_size, e.master_addr, e.master_port) == \
        ("slurm", 3, 3, 16, "gpu07", 29500)


def test_resolve_torchrun_wins_over_slurm_and_single_default():
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "9", "SLURM_LOCALID": "0"}
    assert resolve_launch_env(env).launcher == "torchrun"
    e = resolve_launch_env({})
    assert (e.launcher, e.rank, e.world_size, e.master_port) == ("single", 0, 1, 0)   # any free port
    assert resolve_launch_env({"MASTER_PORT": "1234"}).master_port == 1234


def test_resolve_env_from_os_environ(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "h[2-3]")
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    e = resolve_launch_env()
    assert (e.rank, e.world_size, e.master_addr) == (1, 2, "h2")


@pytest.mark.parametrize("env,fragment", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside world_size"),
    ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_LOCALID"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "SLURM_NODELIST"),
])
def test_resolve_env_errors(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_launch_env(env)


# ----------------------------------------------------------------------------- validation

DENSE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=128,
             ffn_hidden_size=128)
MOE = dict(DENSE, num_moe_experts=8, moe_ffn_hidden_size=32)


def _violations(cfg, world, model):
    with pytest.raises(ParallelConfigError) as exc:
        validate_parallel_config(cfg, world, ModelConfig(**model) if model is not None else None)
    return exc.value.violations


def test_valid_layouts_pass():
    validate_parallel_config(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 8,
                             ModelConfig(**DENSE))
    validate_parallel_config(ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                            expert_tensor_parallel_size=1, sequence_parallel=True), 2,
                             ModelConfig(**MOE))
    cfg = ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2)
    validate_parallel_config(cfg, 16, ModelConfig(**DENSE))
    assert cfg.data_parallel_size(16) == 2 and cfg.expert_data_parallel_size(16) == 4


@pytest.mark.parametrize("cfg,world,model,needles", [
    (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2), 12, None,
     ["world_size=12", "2x2x2 = 8"]),
    (ParallelConfig(expert_model_parallel_size=4, expert_tensor_parallel_size=2, pipeline_model_parallel_size=1),
     4, MOE, ["expert_tensor_parallel_size x expert_model_parallel_size", "2x4x1 = 8"]),
    (ParallelConfig(tensor_model_parallel_size=3), 3, dict(DENSE, num_attention_heads=8),
     ["num_attention_heads=8", "tensor_model_parallel_size=3"]),
    (ParallelConfig(tensor_model_parallel_size=4), 4, dict(DENSE, num_query_groups=2),
     ["num_query_groups=2", "tensor_model_parallel_size=4"]),
    (ParallelConfig(pipeline_model_parallel_size=3), 3, DENSE, ["num_layers=4", "= 3"]),
    (ParallelConfig(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2), 4, DENSE,
     ["num_layers=4", "4x2 = 8"]),
    (ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), 2, DENSE,
     ["virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size > 2"]),
    (ParallelConfig(tensor_model_parallel_size=2), 2, MOE, ["MoE", "sequence_parallel=True"]),
    (ParallelConfig(expert_model_parallel_size=3), 3, MOE, ["num_moe_experts=8", "expert_model_parallel_size=3"]),
    (ParallelConfig(expert_model_parallel_size=2), 2, DENSE, ["expert_model_parallel_size=2", "num_moe_experts"]),
    (ParallelConfig(sequence_parallel=True), 1, None, ["sequence_parallel=True", "tensor_model_parallel_size > 1"]),
    (ParallelConfig(tensor_model_parallel_size=2), 2, dict(DENSE, vocab_size=127), ["vocab_size=127"]),
    (ParallelConfig(tensor_model_parallel_size=2), 2, dict(DENSE, ffn_hidden_size=129), ["ffn_hidden_size=129"]),
    (ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=2), 2,
     dict(MOE, moe_ffn_hidden_size=33), ["moe_ffn_hidden_size=33", "expert_tensor_parallel_size=2"]),
])
def test_each_rule_names_keys_and_numbers(cfg, world, model, needles):
    msg = "\n".join(_violations(cfg, world, model))
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"


def test_all_violations_collected_in_one_error():
    cfg = ParallelConfig(tensor_model_parallel_size=3, pipeline_model_parallel_size=3)
    v = _violations(cfg, 8, DENSE)
    assert len(v) >= 4  # world, layers, heads, query groups (+ ffn, vocab)
    keys = " ".join(v)
    for k in ("world_size=8", "num_layers=4", "num_attention_heads=8", "num_query_groups=4"):
        assert k in keys


@pytest.mark.parametrize("bad", [dict(tensor_model_parallel_size=0), dict(pipeline_model_parallel_size=-1),
                                 dict(expert_model_parallel_size=1.5), dict(context_parallel_size=True)])
def test_sizes_must_be_positive_ints(bad):
    v = _violations(ParallelConfig(**bad), 4, None)
    assert any(next(iter(bad)) in x for x in v)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size"):
        parallel_config_from_dict({"tensor_parallel_size": 2})
    assert parallel_config_from_dict({"tensor_model_parallel_size": 2}).tensor_model_parallel_size == 2


# ----------------------------------------------------------------------------- megatron groups


def _expected_groups(rank, world, tp, pp, cp, ep, etp):
    """Independent expectation of megatron's rank layout: dense order tp-cp-dp-pp, expert order
    etp-ep-edp-pp (fastest first)."""
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)

    def coords(r, sizes):
        out = []
        for s in sizes:
            out.append(r % s)
            r //= s
        return out

    def rank_of(c, sizes):
        r, mul = 0, 1
        for x, s in zip(c, sizes):
            r += x * mul
            mul *= s
        return r

    def group(r, sizes, axis):
        c = coords(r, sizes)
        members = []
        for i in range(sizes[axis]):
            c2 = list(c)
            c2[axis] = i
            members.append(rank_of(c2, sizes))
        return sorted(members)

    dense = [tp, cp, dp, pp]
    expert = [etp, ep, edp, pp]
    return {"tp": group(rank, dense, 0), "cp": group(rank, dense, 1), "dp": group(rank, dense, 2),
            "pp": group(rank, dense, 3), "etp": group(rank, expert, 0), "ep": group(rank, expert, 1),
            "edp": group(rank, expert, 2)}


def _groups_body(rank, world, cfg, model):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    initialize_model_parallel(cfg, seed=7, model=model)
    ranks = dist.get_process_group_ranks
    got = {"tp": ranks(ps.get_tensor_model_parallel_group()), "pp": ranks(ps.get_pipeline_model_parallel_group()),
           "dp": ranks(ps.get_data_parallel_group()), "cp": ranks(ps.get_context_parallel_group()),
           "ep": ranks(ps.get_expert_model_parallel_group()), "etp": ranks(ps.get_expert_tensor_parallel_group()),
           "edp": ranks(ps.get_expert_data_parallel_group())}
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    states = sorted(get_cuda_rng_tracker().get_states())
    destroy_model_parallel()
    return {k: sorted(v) for k, v in got.items()}, states


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cfg,world,model", [
    (ParallelConfig(tensor_model_parallel_size=2), 2, None),
    (ParallelConfig(pipeline_model_parallel_size=2), 2, None),
    (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4, None),
    (ParallelConfig(expert_model_parallel_size=2), 2, ModelConfig(**MOE)),
    (ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1,
                    sequence_parallel=True), 2, ModelConfig(**MOE)),
    (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2,
                    expert_tensor_parallel_size=1, sequence_parallel=True), 4, ModelConfig(**MOE)),
])
def test_initialize_model_parallel_groups(cfg, world, model):
    results = run_ranks(_groups_body, world, cfg, model, timeout=45)
    for rank, (got, states) in enumerate(results):
        want = _expected_groups(rank, world, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                                cfg.context_parallel_size, cfg.expert_model_parallel_size, cfg.etp)
        assert got == want, f"rank {rank}: {got} != {want}"
        assert "model-parallel-rng" in states and "expert-parallel-rng" in states


def _invalid_body(rank, world):
    from megatron.core import parallel_state as ps

    try:
        initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=3), model=None)
    except ParallelConfigError as e:
        return str(e), ps.model_parallel_is_initialized()
    return None, ps.model_parallel_is_initialized()


@pytest.mark.timeout(60)
def test_invalid_layout_raises_before_creating_groups():
    for msg, initialised in run_ranks(_invalid_body, 2, timeout=45):
        assert msg is not None and "world_size=2" in msg
        assert initialised is False


def test_initialize_without_process_group_is_clear():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        initialize_model_parallel(ParallelConfig())


def test_expected_groups_helper_is_consistent():
    # sanity of the test's own expectation: every axis partitions the world
    for tp, pp, ep in itertools.product((1, 2), (1, 2), (1, 2)):
        world = 8
        groups = [_expected_groups(r, world, tp, pp, 1, ep, 1) for r in range(world)]
        for axis in ("tp", "pp", "dp", "ep"):
            for r in range(world):
                assert r in groups[r][axis]
                assert all(groups[m][axis] == groups[r][axis] for m in groups[r][axis])
    assert torch.distributed.is_available()


# ----------------------------------------------------------------------------- init_distributed


def _init_child(rank, port, conn):
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch.distributed as dist

        from megatron_rl.parallel import init_distributed

        env = {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NTASKS": "2",
               "SLURM_NODELIST": "localhost,otherhost", "MASTER_PORT": str(port)}
        launch = init_distributed(env=env, timeout_s=60)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        conn.send((launch.rank, launch.world_size, dist.get_backend(), float(t)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        conn.send(repr(e))


@pytest.mark.timeout(60)
def test_init_distributed_from_slurm_env_uses_gloo_on_cpu():
    import multiprocessing as mp

    from megatron_rl.rollout.sglang_server import find_free_port

    port = find_free_port()
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for r in range(2):
        a, b = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_init_child, args=(r, port, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        out = []
        for a in pipes:
            assert a.poll(45), "init_distributed did not finish"
            out.append(a.recv())
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert out == [(0, 2, "gloo", 3.0), (1, 2, "gloo", 3.0)], out


def _single_child(release, conn):
    import os

    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        import torch.distributed as dist

        from megatron_rl.parallel import init_distributed

        launch = init_distributed(backend="gloo", env={}, timeout_s=60)
        t = torch.ones(1)
        dist.all_reduce(t)
        conn.send((launch.launcher, float(t)))
        release.wait(45)  # both groups alive at once
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        conn.send(repr(e))


@pytest.mark.timeout(60)
def test_two_single_process_jobs_on_one_machine_at_once():
    """Two jobs without launcher variables (one process each) hold their process groups at the same time: a
    fixed default port (29500) made the second fail with EADDRINUSE."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    release = ctx.Event()
    pipes, procs = [], []
    try:
        for _ in range(2):
            a, b = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_single_child, args=(release, b), daemon=True)
            p.start()
            pipes.append(a)
            procs.append(p)
        out = []
        for a in pipes:
            assert a.poll(45), "init_distributed did not finish"
            out.append(a.recv())
    finally:
        release.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert out == [("single", 1.0), ("single", 1.0)], out
