"""Benchmark: ``compute_rollout_correction`` side by side with verl 0.9.1's helper, in one run.

The batch and settings of issue 9: 64 x 4096 tokens (right-padded, lengths T/4..T), token-level TIS
(C = 2) + seq_mean_k1 + seq_max_k2 rejection, every metric, ``--threads 2``. Both functions get the
same float32 tensors; calls alternate (ours, verl, ours, ...) so machine noise hits both alike.
Reported: min and median wall-clock time, and the min CPU time of the process (less sensitive to
other jobs on a shared machine), plus a sanity check that both keep the same tokens.

Also reported: the cost relative to a log-softmax over the same tokens at vocab 32768 (target < 2 %)
and the collectives per call on 2 gloo DP ranks x 2 CP ranks (target <= 3).

verl is never a dependency of this project. To compare, install it into a scratch directory (not the
project's venv) and point the benchmark at it::

    python tools/bench_correction.py --install-verl          # pip --no-deps into /tmp/megatron_rl_bench_verl
    OMP_NUM_THREADS=2 python tools/bench_correction.py       # finds it there (or --verl-path DIR)

Without an importable verl the benchmark still runs and prints a note instead of verl's numbers.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from megatron_rl.correction import RolloutCorrectionConfig, compute_rollout_correction
from megatron_rl.testing.distributed import run_ranks

DEFAULT_VERL_PATH = "/tmp/megatron_rl_bench_verl"
# verl 0.9.1 without its dependencies, plus the light packages its helper's imports need.
VERL_PACKAGES = ("verl==0.9.1", "ray", "tensordict", "omegaconf", "antlr4-python3-runtime==4.9.3", "codetiming",
                 "msgpack", "pyvers")

IS = dict(rollout_is="token", rollout_is_threshold=2.0)
RS = dict(rollout_rs="seq_mean_k1,seq_max_k2", rollout_rs_threshold="0.999_1.001,2.0")
CFG = dict(**IS, **RS)
COUNT_CFG = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True,
                 rollout_rs="token_k1,seq_mean_k3,seq_max_k2", rollout_rs_threshold="0.5_2.0,0.01,2.0",
                 rollout_token_veto_threshold=1e-4)


def batch(B, T, seed=0):
    """Rollout log-probs in [-3, 0], training log-probs 0.05 * N(0, 1) away, lengths T/4..T."""
    g = torch.Generator().manual_seed(seed)
    lr = -torch.rand(B, T, generator=g) * 3
    lt = (lr + 0.05 * torch.randn(B, T, generator=g)).clamp(max=0)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return lt, lr, mask


def install_verl(path):
    """pip-install verl 0.9.1 (no dependencies) and the light packages it imports into ``path``."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", path, *VERL_PACKAGES]
    print("installing into", path, ":", " ".join(cmd[4:]), flush=True)
    subprocess.run(cmd, check=True)


def add_verl_path(path):
    """Put the scratch directory holding verl (``install_verl``) first on ``sys.path`` if it exists."""
    if path and os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)


def load_verl(path):
    """verl's ``compute_rollout_correction_and_rejection_mask``, or (None, why)."""
    add_verl_path(path)
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
        import verl
    except Exception as exc:  # noqa: BLE001 - any import failure means "no verl to compare with"
        return None, f"{type(exc).__name__}: {exc}"
    version = getattr(verl, "__version__", "?")
    return compute_rollout_correction_and_rejection_mask, version


def time_side_by_side(fns, reps):
    """{name: (wall times, cpu times)} with the calls of the functions interleaved."""
    out = {name: ([], []) for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            out[name][0].append(time.perf_counter() - w0)
            out[name][1].append(time.process_time() - c0)
    return out


def _count_body(rank, world):
    cp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    lt, lr, mask = batch(8, 512, seed=rank // 2)
    sl = slice(0, 256) if rank % 2 == 0 else slice(256, None)
    res = compute_rollout_correction(lt[:, sl], lr[:, sl], mask[:, sl], RolloutCorrectionConfig(**COUNT_CFG),
                                     group=dist.group.WORLD, cp_group=cp)
    return res.num_collectives


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--verl-path", default=os.environ.get("MEGATRON_RL_BENCH_VERL", DEFAULT_VERL_PATH),
                    help="directory holding verl 0.9.1 (pip --target); default %(default)s")
    ap.add_argument("--install-verl", action="store_true", help="pip-install verl 0.9.1 into --verl-path first")
    ap.add_argument("--no-collectives", action="store_true", help="skip the 4-process collective count")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.install_verl:
        install_verl(a.verl_path)
    verl_fn, verl_info = load_verl(a.verl_path)

    cfg = RolloutCorrectionConfig(**CFG)
    lt, lr, mask = batch(a.batch, a.seq)
    fns = {"megatron_rl": lambda: compute_rollout_correction(lt, lr, mask, cfg)}
    if verl_fn is not None:
        fns["verl " + verl_info] = lambda: verl_fn(lt, lr, mask, **CFG)
    times = time_side_by_side(fns, a.reps)

    tokens = a.batch * a.seq
    print(f"tokens {tokens:,} ({a.batch} x {a.seq}, {int(mask.sum()):,} valid), torch threads {a.threads}, "
          f"token TIS + {RS['rollout_rs']} RS, all metrics, {a.reps} interleaved calls each")
    print(f"{'':24s} {'wall min':>10s} {'wall median':>12s} {'cpu min':>10s}")
    for name, (wall, cpu) in times.items():
        print(f"{name:24s} {min(wall) * 1e3:8.1f} ms {statistics.median(wall) * 1e3:9.1f} ms "
              f"{min(cpu) * 1e3:7.1f} ms")
    if verl_fn is None:
        print(f"verl: not importable ({verl_info}); no side-by-side numbers. Install it into a scratch "
              f"directory with --install-verl (or pip install --no-deps --target DIR {' '.join(VERL_PACKAGES)}) "
              f"and pass --verl-path DIR.")
    else:
        ours_t, verl_t = (min(times[n][0]) for n in fns)
        print(f"ratio megatron_rl / verl (wall min)  {ours_t / verl_t:6.2f}   (target <= 1)")
        ours = compute_rollout_correction(lt, lr, mask, cfg)
        _, verl_mask, _ = verl_fn(lt, lr, mask, **CFG)
        same = int((ours.response_mask.bool() == verl_mask.bool()).sum())
        print(f"kept tokens: megatron_rl {int(ours.response_mask.sum()):,}, verl {int(verl_mask.sum()):,}; "
              f"same decision on {100.0 * same / tokens:.3f} % of positions (k1 bounds: ours on r, verl on 1/r)")

    sub = tokens // 64
    logits = torch.randn(sub, a.vocab)
    lsm = time_side_by_side({"lsm": lambda: torch.log_softmax(logits, dim=-1)}, max(3, a.reps // 4))["lsm"][0]
    t_lsm = min(lsm) * 64
    t_ours = min(times["megatron_rl"][0])
    print(f"log_softmax @ V={a.vocab} (x64)  {t_lsm * 1e3:9.1f} ms  (measured on {sub} tokens); "
          f"correction / log_softmax {100 * t_ours / t_lsm:.2f} %   (target < 2 %)")
    if not a.no_collectives:
        n_coll = run_ranks(_count_body, 4, timeout=120)
        print(f"collectives per call (DP2 x CP2)  {max(n_coll)}   (target <= 3)")


if __name__ == "__main__":
    main()
