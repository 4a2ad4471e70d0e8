"""``actor.bf16``: bf16 parameters and compute, fp32 main parameters and gradients, against the fp32 actor and
HF transformers in fp32 on the same batch (CPU, gloo).

Each case builds, in the same ranks, the fp32 actor and the bf16 actor from one tiny HF checkpoint and runs the
log-prob pass and one train step on the same batch:

* log-probs of the bf16 actor are within bf16 tolerance of the fp32 actor's and of HF's fp32 log-probs
  (``BF16_LOGP_ATOL``; the fp32 actor itself matches HF to 1e-5), and differ from them (bf16 really ran);
* the train step's loss and pre-clip grad norm are close to the fp32 actor's (relative ``BF16_STEP_RTOL``);
* every model parameter is bf16, every main parameter the optimizer steps and every ``main_grad`` is fp32, and
  after the step each bf16 parameter is exactly its fp32 main parameter rounded to bf16;
* ``actor.fp32_output_layer``: the output layer's weight is an fp32 parameter and the logits are exactly the fp32
  matmul of the bf16 hidden states (no bf16 rounding of the logits).

Layouts: TP1, TP2 x PP2 (4 ranks) and a tiny Qwen3-MoE at EP2 with r3 routing replay (the same forced routing in
both actors, so bf16 cannot flip an expert choice).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_bf16.py -q``
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import RolloutBatch
from megatron_rl.testing.actor_reference import actor_on_shard, hf_token_log_probs, load_hf_reference, policy_data
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import NO_LOAD_BALANCING, knobs, named_job

transformers = pytest.importorskip("transformers")

T = 0.8
#: bf16 keeps 8 significant bits (relative rounding 2^-9 per operation); through the tiny models the log-probs
#: move by a few 1e-3 (measured max |diff| 3.3e-3 TP1, 3.4e-3 TP2xPP2, 4.0e-3 MoE EP2; grad norm within 0.13 %)
BF16_LOGP_ATOL = 1e-2
BF16_STEP_RTOL = 2e-2
E, K, NL = 8, 2, 2


@pytest.fixture(scope="module")
def models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=21, num_hidden_layers=4),
            "moe": tiny_hf_model("qwen3_moe", seed=31, num_hidden_layers=NL, num_experts=E, num_experts_per_tok=K)}


def _data(vocab, moe, B=8, seed=0):
    batch, old, adv, mask, is_w = policy_data(vocab, B, seed, prompt_len=(1, 6), response_len=(2, 10),
                                              reject_token=True)
    if moe:  # forced routing for every position, as an engine would have captured it (r3)
        g = torch.Generator().manual_seed(seed + 1)
        forced = torch.rand(B, batch.max_length, NL, E, generator=g).argsort(-1)[..., :K]
        rows = [forced[b, : int(n) - 1].to(torch.uint8) for b, n in enumerate(batch.lengths)]
        seqs = [batch.tokens[b, : int(n)].tolist() for b, n in enumerate(batch.lengths)]
        prompts = [s[: int(p)] for s, p in zip(seqs, batch.prompt_lengths)]
        responses = [s[int(p):] for s, p in zip(seqs, batch.prompt_lengths)]
        lps = [batch.rollout_log_probs[b, int(p) - 1: int(n) - 1].tolist()
               for b, (p, n) in enumerate(zip(batch.prompt_lengths, batch.lengths))]
        batch = RolloutBatch.from_sequences(prompts, responses, lps, routing=rows)
    return batch, old, adv, mask, is_w


def _dtypes(actor):
    model = {p.dtype for c in actor.model for p in c.module.parameters()}
    grads = {p.main_grad.dtype for c in actor.model for p in c.module.parameters()}
    main = {p.dtype for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
            for g in o.optimizer.param_groups for p in g["params"]}
    return {"model": model, "main_grad": grads, "main": main}


def _rounded_from_main(actor) -> bool:
    """Every bf16 model parameter == its fp32 main parameter rounded to bf16 (megatron's fp32 master copy)."""
    n = 0
    for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for model_group, main_group in zip(o.float16_groups, o.fp32_from_float16_groups):
            for p, m in zip(model_group, main_group):
                assert m.dtype == torch.float32 and p.dtype == torch.bfloat16
                if not torch.equal(p.detach(), m.detach().to(torch.bfloat16)):
                    return False
                n += 1
    return n > 0


def _run(actor, shard, data, start, end):
    batch, old, adv, mask, is_w = data
    W = shard.max_length - 1
    lp, _ = actor.compute_log_probs(shard, T)
    metrics = actor.train_step(shard, old[start:end, :W], adv[start:end], mask[start:end, :W],
                               is_w[start:end, :W], T)
    return lp, metrics


def _rank(rank, world, jobs, data):
    out = {}
    for name, job in jobs.items():
        actor, shard, start, end = actor_on_shard(job, data[0])
        before = _dtypes(actor)
        lp, metrics = _run(actor, shard, data, start, end)
        out[name] = {"lp": lp, "metrics": metrics, "rows": (start, end), "dtypes": before,
                     "rounded": _rounded_from_main(actor) if name == "bf16" else None}
        del actor
    return out


def _gather(results, name, batch):
    W = batch.max_length - 1
    lp = torch.zeros(batch.num_rows, W)
    for r in results:
        s, e = r[name]["rows"]
        lp[s:e, : r[name]["lp"].shape[1]] = r[name]["lp"]
    return lp


CASES = [("qwen2", dict(), 1), ("qwen2", dict(tp=2, pp=2), 4), ("moe", dict(ep=2), 2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key,layout,world", CASES, ids=["tp1", "tp2pp2", "moe-ep2-r3"])
def test_bf16_actor_close_to_fp32_and_hf(models, key, layout, world):
    moe = key == "moe"
    replay = (*NO_LOAD_BALANCING, "actor.routing_replay=r3") if moe else ()
    jobs = {"fp32": named_job("actor_ppo", *replay, *knobs(**layout), hf=models[key]),
            "bf16": named_job("actor_ppo", *replay, *knobs(bf16=True, **layout), hf=models[key])}
    data = _data(jobs["fp32"].model.vocab_size, moe)
    batch = data[0]
    results = run_ranks(_rank, world, jobs, data, timeout=250)
    valid = batch.response_mask.bool()
    lp32, lp16 = _gather(results, "fp32", batch), _gather(results, "bf16", batch)
    diff = (lp16 - lp32)[valid].abs()
    assert 0 < diff.max() <= BF16_LOGP_ATOL, f"bf16 vs fp32 actor log-probs: max |diff| {diff.max():.3g}"
    if not moe:  # HF in fp32 (forced routing: the r3 tests compare the fp32 actor with HF)
        hf = hf_token_log_probs(load_hf_reference(models[key]), batch.tokens, T).detach()
        torch.testing.assert_close(lp32[valid], hf[valid], rtol=0, atol=1e-5)
        assert (lp16 - hf)[valid].abs().max() <= BF16_LOGP_ATOL
    m32, m16 = results[0]["fp32"]["metrics"], results[0]["bf16"]["metrics"]
    assert all(r["bf16"]["metrics"] == m16 for r in results), "metrics differ between ranks"
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert m16[k] == pytest.approx(m32[k], rel=BF16_STEP_RTOL), k
    assert m16["actor/grad_norm"] != m32["actor/grad_norm"]
    for r in results:
        assert r["fp32"]["dtypes"] == {"model": {torch.float32}, "main_grad": {torch.float32}, "main": {torch.float32}}
        assert r["bf16"]["dtypes"] == {"model": {torch.bfloat16}, "main_grad": {torch.float32},
                                       "main": {torch.float32}}
        assert r["bf16"]["rounded"], "bf16 parameters must be their fp32 main parameters rounded after the step"


def _rank_output_layer(rank, world, job, data):
    actor, shard, start, end = actor_on_shard(job, data[0])
    chunk = actor.model[-1].module
    seen = {}

    def hook(module, args, kwargs, out):
        x, w = args[0], kwargs.get("weight") if kwargs.get("weight") is not None else module.weight
        if not seen:  # the first micro-batch of the log-prob pass (before the step changes the weight)
            seen.update(x=x.detach().clone(), w=w.detach().clone(), y=out[0].detach().clone())

    h = chunk.output_layer.register_forward_hook(hook, with_kwargs=True)
    lp, metrics = _run(actor, shard, data, start, end)
    h.remove()
    w = actor.model[-1].module.output_layer.weight
    return {"x": seen["x"], "w": seen["w"], "y": seen["y"], "weight_dtype": w.dtype,
            "other": {p.dtype for n, p in chunk.named_parameters() if "output_layer" not in n},
            "metrics": metrics, "lp": lp}


@pytest.mark.timeout(200)
def test_fp32_output_layer_computes_logits_in_fp32(models):
    job = named_job("actor_ppo", *knobs(bf16=True, fp32_output_layer=True, use_distributed_optimizer=True),
                    hf=models["qwen2"])
    data = _data(job.model.vocab_size, False)
    r = run_ranks(_rank_output_layer, 1, job, data, timeout=150)[0]
    assert r["weight_dtype"] == torch.float32 and r["other"] == {torch.bfloat16}
    assert r["x"].dtype == torch.float32 and r["y"].dtype == torch.float32
    # the input is the bf16 hidden state, exactly (upcast), and the logits its fp32 matmul with the fp32 weight
    assert torch.equal(r["x"], r["x"].to(torch.bfloat16).float())
    torch.testing.assert_close(r["y"], r["x"] @ r["w"].t(), rtol=1e-6, atol=1e-6)
    assert not torch.equal(r["y"].to(torch.bfloat16).float(), r["y"]), "fp32 logits are not bf16 values"
    assert all(v == v for v in r["metrics"].values())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quickstart_three_steps_with_bf16_actor_are_finite(tmp_path, task_model):
    """``configs/tiny_cpu.yaml`` (4 gloo ranks, TP2 x PP2, the quickstart's model) with ``actor.bf16=true``: 3 RL
    steps and the final checkpoint, every logged number finite. 8 prompts per step (64 rows, 4 micro-batches of 16
    through the pipeline, the config's 2 PPO mini-batches) instead of the config's 64: finiteness needs every
    piece of the bf16 step to run, not the rows the quickstart learns with."""
    import json
    import math
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    model = task_model(task="copy", seed=0, hidden_size=128, num_layers=2)
    run = tmp_path / "run"
    # CHECK=0: the launcher's config check (one more interpreter importing megatron) is tested on its own
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", CHECK="0")
    r = subprocess.run(["bash", os.path.join(root, "launch", "torchrun.sh"), "--nproc-per-node", "4", "--log-dir",
                        str(tmp_path / "logs"), "--config", "configs/tiny_cpu.yaml", f"actor.load_hf={model}",
                        "actor.bf16=true", "data.prompts_per_step=8", "actor.micro_batch_size=16",
                        "trainer.steps=3", f"trainer.run_dir={run}", "trainer.progress=false"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(run / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    assert [m["step"] for m in records] == [1, 2, 3]
    for m in records:
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "rollout_corr/training_ppl"):
            assert k in m and math.isfinite(m[k]), (m["step"], k, m.get(k))
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert (run / "checkpoints" / "step_3" / "COMPLETE").is_file()
