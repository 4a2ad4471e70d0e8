"""Asynchronous rollouts (megatron_rl/trainer/async_rollout.py) with a real embedded engine and a simulated
trainer that publishes new weights after every step:

* staleness is never exceeded, over many steps, with a deliberately slow trainer and a deliberately slow
  engine, in finish and interrupt mode, for k = 0, 1, 2;
* an interrupted partial rollout tags every token with the version that produced it, and each token's
  rollout log-prob is the one an independent HF forward with *that* version's weights gives (and not the
  other version's);
* the policy-lag metrics equal a float64 per-token reference, exactly over 2 DP ranks;
* an engine failure and a weight-load failure in the producer thread reach the trainer.
"""
import math
import time

import pytest
import torch

from megatron_rl.correction.lag import policy_lag_metrics
from megatron_rl.rollout.base import RolloutError, SamplingParams, WeightSyncError
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.tasks.char_tokenizer import build_task_model
from megatron_rl.testing.routing_reference import hf_own_routing
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.rollout.versions import parse_version
from megatron_rl.trainer.async_rollout import RolloutProducer, token_lag_tensor

PROMPTS = [[3, 4, 5], [6, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_task_model(str(tmp_path_factory.mktemp("m") / "m"), task="copy", seed=0, hidden_size=32,
                            num_layers=1)


class SlowEngine:
    """The real engine, each generate call delayed (a deliberately slow engine)."""

    def __init__(self, engine, delay_s):
        self.engine, self.delay_s = engine, delay_s

    @property
    def weight_version(self):
        return self.engine.weight_version

    def generate(self, prompt_ids, sampling, n=1, seed=None):
        time.sleep(self.delay_s)
        return self.engine.generate(prompt_ids, sampling, n=n, seed=seed)


def _version_weights(engine, v):
    """Version v of the weights: the initial ones moved by a fixed random direction v times (large enough
    that log-probs of different versions differ clearly)."""
    g = torch.Generator().manual_seed(1234)
    base = {k: t.detach().float().clone() for k, t in engine.model.state_dict().items()}
    return {k: t + 1.0 * v * torch.randn(t.shape, generator=g) * (t.std() if t.numel() > 1 else 1.0)
            for k, t in base.items()}


def _simulate(model_dir, k, interrupt, engine_delay, trainer_delay, steps, max_new_tokens=6, segment=2):
    engine = EmbeddedEngine(model_dir, dtype="float32", seed=0, weight_version="step-0")
    weights = {v: _version_weights(engine, v) for v in range(steps + 1)}
    engine.update_weights_from_state_dict(weights[0], "step-0")
    slow = SlowEngine(engine, engine_delay)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True)

    def gen(step, view, tag):
        assert view.weight_version == tag
        return view.generate(PROMPTS, sampling, n=2, seed=step)

    producer = RolloutProducer(slow, gen, lambda sd, tag: engine.update_weights_from_state_dict(sd, tag),
                               start_step=0, max_staleness=k, interrupt=interrupt,
                               segment_tokens=segment).start_thread()
    got = []
    try:
        for t in range(steps):
            got.append(producer.get(t))
            time.sleep(trainer_delay)
            producer.publish(t + 1, weights[t + 1])
    finally:
        producer.close()
    return got, weights


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("interrupt", [False, True], ids=["finish", "interrupt"])
@pytest.mark.parametrize("slow", ["trainer", "engine"])
def test_staleness_is_never_exceeded(model_dir, k, interrupt, slow):
    delays = (0.0, 0.15) if slow == "trainer" else (0.1, 0.0)
    got, _ = _simulate(model_dir, k, interrupt, *delays, steps=8)
    for t, rollouts in enumerate(got):
        assert len(rollouts) == len(PROMPTS) * 2
        for r in rollouts:
            versions = r.info["token_versions"]
            assert len(versions) == len(r.response_ids) == 6
            assert all(0 <= t - v <= k for v in versions), (t, versions)
            assert versions == sorted(versions)                   # continued segments only move forward
            if interrupt:
                assert versions[0] >= max(t - k, 0)
            else:
                assert set(versions) == {max(t - k, 0)}           # finish mode: the pinned version only


@pytest.mark.timeout(300)
def test_interrupted_partial_rollout_tags_and_log_probs(model_dir):
    """k = 1, interrupt every 2 tokens, a slow engine and a fast trainer: the trainer publishes version t while
    step t is being generated from version t-1, so later segments continue on version t."""
    from transformers import AutoModelForCausalLM

    got, weights = _simulate(model_dir, k=1, interrupt=True, engine_delay=0.4, trainer_delay=0.0, steps=4)
    mixed = [(t, r) for t, rs in enumerate(got) for r in rs if len(set(r.info["token_versions"])) > 1]
    assert mixed, "no rollout was interrupted"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def scores(version, prompt, response):
        hf.load_state_dict(weights[version])
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([prompt + response])).logits[0].double(), -1)
        return [float(lsm[len(prompt) - 1 + j, response[j]]) for j in range(len(response))]

    for t, r in mixed:
        versions = r.info["token_versions"]
        by_version = {v: scores(v, r.prompt_ids, r.response_ids) for v in set(versions)}
        for j, v in enumerate(versions):
            assert abs(by_version[v][j] - r.rollout_log_probs[j]) < 1e-4, (t, j, v)
        # and the other version would have given clearly different log-probs (the check can fail)
        for v in by_version:
            other = [u for u in by_version if u != v][0]
            js = [j for j, u in enumerate(versions) if u == v]
            assert max(abs(by_version[other][j] - r.rollout_log_probs[j]) for j in js) > 1e-2, (t, v)


@pytest.mark.timeout(120)
def test_engine_failure_and_weight_load_failure_reach_the_trainer(model_dir):
    engine = EmbeddedEngine(model_dir, dtype="float32", seed=0, weight_version="step-0")
    sampling = SamplingParams(max_new_tokens=3)

    def gen(step, view, tag):
        if step == 2:
            raise RolloutError("engine died (test)")
        return view.generate(PROMPTS, sampling, n=1, seed=step)

    p = RolloutProducer(engine, gen, lambda sd, tag: engine.update_weights_from_state_dict(sd, tag), 0, 1).start_thread()
    sd = {k: v.clone() for k, v in engine.model.state_dict().items()}
    p.get(0)
    p.publish(1, sd)
    p.get(1)
    p.publish(2, sd)
    with pytest.raises(RolloutError, match="engine died"):
        p.get(2)
    p.close()

    def refuse(sd, tag):
        raise WeightSyncError(f"refused {tag} (test)")

    p = RolloutProducer(engine, lambda s, view, tag: view.generate(PROMPTS, sampling, n=1, seed=s), refuse, 0, 1)
    p.start_thread()
    p.get(0)
    p.get(1)                     # still version 0 (k = 1)
    p.publish(1, sd)             # step 2 needs version 1: loading it fails in the producer thread
    with pytest.raises(WeightSyncError, match="refused step-1"):
        p.get(2)
    p.close()


def _reference_lag_metrics(train, roll, mask, lag, max_lag):
    out = {}
    rows = [(float(t), float(r), int(l)) for t, r, m, l in zip(train.flatten(), roll.flatten(), mask.flatten(),
                                                                 lag.flatten()) if m]
    out["rollout/staleness_mean"] = sum(l for _, _, l in rows) / len(rows)
    for lv in range(max_lag + 1):
        sel = [(t, r) for t, r, l in rows if l == lv]
        out[f"rollout/staleness_frac_lag{lv}"] = len(sel) / len(rows)
        if sel:
            ds = [max(-20.0, min(20.0, t - r)) for t, r in sel]
            out[f"rollout_corr/lag{lv}_kl"] = sum(-d for d in ds) / len(ds)
            out[f"rollout_corr/lag{lv}_k3_kl"] = sum(math.exp(d) - d - 1 for d in ds) / len(ds)
    return out


def _lag_inputs():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(6, 9, generator=g, dtype=torch.float64) * 3
    roll = train + 0.2 * torch.randn(6, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    lag = torch.randint(0, 3, (6, 9), generator=g)
    lag[:, 5:] = 0          # lag 2 is rare, lag 1 and 0 common
    return train, roll, mask, lag


def _lag_body(rank, world):
    import torch.distributed as dist

    train, roll, mask, lag = _lag_inputs()
    rows = slice(rank * 3, rank * 3 + 3)
    return policy_lag_metrics(train[rows], roll[rows], mask[rows], lag[rows], 3, group=dist.group.WORLD)


@pytest.mark.timeout(120)
def test_policy_lag_metrics_vs_reference_single_and_dp2():
    train, roll, mask, lag = _lag_inputs()
    ref = _reference_lag_metrics(train, roll, mask, lag, 3)
    single = policy_lag_metrics(train, roll, mask, lag, 3)
    dp2 = run_ranks(_lag_body, 2, timeout=60)
    for got in (single, dp2[0], dp2[1]):
        for key, val in ref.items():
            assert got[key] == pytest.approx(val, rel=1e-9, abs=1e-12), key
        assert "rollout_corr/lag3_kl" not in got              # no token of lag 3: no NaN, no key
        assert got["rollout/staleness_tokens_lag3"] == 0
        assert got["rollout/staleness_max"] == float(lag[mask.bool()].max())
    with pytest.raises(ValueError, match="token_lag outside"):
        policy_lag_metrics(train, roll, mask, lag + 5, 3)


def test_token_lag_tensor_aligns_with_the_batch_layout():
    from megatron_rl.actor.batch import RolloutBatch

    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    versions = [[4, 5], [3, 4, 5]]
    batch = RolloutBatch.from_sequences(prompts, responses, [[-1.0, -2.0], [-3.0, -4.0, -5.0]])
    lag = token_lag_tensor([3, 1], versions, 5, batch.rollout_log_probs.shape[1])
    m = batch.response_mask.bool()
    assert lag[m].tolist() == [1, 0, 2, 1, 0]
    assert batch.rollout_log_probs[m].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert parse_version("step-12") == 12
    with pytest.raises(ValueError, match="step-<int>"):
        parse_version("init")


@pytest.mark.timeout(120)
def test_segmented_generation_keeps_the_moe_routing_of_every_fed_token(tmp_path):
    """Interrupt-mode segments joined back into one rollout carry routing for every fed position
    (``[prompt + response - 1, layers, k]``), equal to the top-k of HF's own routers in a full-sequence fp32
    forward (no weight change between segments here, so one reference holds for all positions)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.testing.tiny_hf import build_tiny_hf_model
    from megatron_rl.trainer.async_rollout import SegmentedEngine

    moe = str(build_tiny_hf_model(tmp_path / "moe", arch="qwen3_moe", seed=41, num_hidden_layers=3, num_experts=8,
                                  num_experts_per_tok=2))
    engine = EmbeddedEngine(moe, dtype="float32", seed=0, weight_version="step-0")
    seg = SegmentedEngine(engine, 2, before_segment=lambda: None)
    out = seg.generate([[5, 9, 11], [7, 8]], SamplingParams(max_new_tokens=7, ignore_eos=True), n=2, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    agree = total = 0
    for r in out:
        assert r.info["segments"] == 4 and len(r.response_ids) == 7
        ids = list(r.prompt_ids) + list(r.response_ids)
        routing = torch.as_tensor(r.routed_experts)
        assert tuple(routing.shape) == (len(ids) - 1, 3, 2)
        ref = hf_own_routing(hf, ids)[: len(ids) - 1]
        same = routing.long().sort(-1).values == ref.long().sort(-1).values
        agree += int(same.all(-1).sum())
        total += same.shape[0] * same.shape[1]
    assert agree / total >= 0.99, agree / total
