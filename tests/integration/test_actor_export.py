"""HF export of the live actor (SGLang weight sync / in-process sync) and bad input to the facade.

* ``full_state_dict_hf()`` right after loading a HF checkpoint returns that checkpoint's tensors bit for
  bit (TP2xPP2, tied embeddings at PP2, Qwen3-MoE at EP2) — gather + unshard + HF mapping are lossless;
  only rank 0 gets it.
* After a train step, ``export_hf(dir)`` writes a directory HF transformers loads, and its fp32
  log-probs equal the actor's own log-probs (<= 1e-4): the export is the trained model.
* Bad input to ``compute_log_probs`` / ``train_step`` raises a clear error before any model work.

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_actor_export.py -q``
"""
import os

import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor import MegatronActor, RolloutBatch
from megatron_rl.plan import actor_spec
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.testing.distributed import RankError, run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def models(tiny_hf_model):
    return {"qwen2": tiny_hf_model("qwen2", seed=31, num_hidden_layers=4),
            "tied": tiny_hf_model("qwen2", seed=32, tie_word_embeddings=True),
            "moe": tiny_hf_model("qwen3_moe", seed=33)}


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 1, 4, 2)]
    responses = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 7, 2, 4)]
    lps = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    return RolloutBatch.from_sequences(prompts, responses, lps)


def _rank_state(rank, world, job):
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    return MegatronActor(actor_spec(job)).full_state_dict_hf()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("key,layout,world", [("qwen2", dict(tp=2, pp=2), 4), ("tied", dict(pp=2), 2),
                                              ("moe", dict(ep=2), 2)], ids=["tp2pp2", "tied-pp2", "moe-ep2"])
def test_full_state_dict_roundtrip_is_bitwise(models, key, layout, world):
    from megatron_rl.convert.storage import read_hf_state_dict

    outs = run_ranks(_rank_state, world, named_job("actor", *knobs(**layout), hf=models[key]), timeout=100)
    assert all(o is None for o in outs[1:])
    ref = read_hf_state_dict(models[key])
    ref.pop("lm_head.weight", None) if key == "tied" else None
    assert sorted(outs[0]) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(outs[0][k], v), k


def _rank_train_export(rank, world, job, batch, out_dir):
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    old, _ = actor.compute_log_probs(batch, 1.0)
    actor.train_step(batch, old, torch.tensor([1.0, -1.0, 0.5, -0.5]), batch.response_mask, None, 1.0)
    actor.export_hf(out_dir)
    lp, _ = actor.compute_log_probs(batch, 1.0)
    return lp, old


@pytest.mark.timeout(120)
def test_export_after_training_is_the_trained_model(models, tmp_path):
    job = named_job("actor", *knobs(tp=2, pp=2, lr=1e-2), hf=models["qwen2"])
    batch = _batch(job.model.vocab_size)
    out = str(tmp_path / "export")
    res = run_ranks(_rank_train_export, 4, job, batch, out, timeout=100)
    lp, old = res[0]
    valid = batch.response_mask.bool()
    assert (lp - old)[valid].abs().max() > 1e-3, "the train step did not change the model"
    m = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = m(input_ids=batch.tokens).logits[:, :-1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
    assert (lp.double() - ref)[valid].abs().max() <= 1e-4
    for name in os.listdir(models["qwen2"]):  # config / tokenizer files travel with the weights
        if name.endswith(".json") and "index" not in name:
            assert os.path.isfile(os.path.join(out, name)), name


def _rank_bad(rank, world, job, what):
    initialize_model_parallel(job.parallel, seed=3, model=job.model)
    actor = MegatronActor(actor_spec(job))
    b = _batch(job.model.vocab_size)
    W = b.max_length - 1
    mask, adv = b.response_mask, torch.ones(4)
    if what == "vocab":
        bad = RolloutBatch.from_sequences([[1, 2]], [[job.model.vocab_size + 3]])
        actor.compute_log_probs(bad, 1.0)
    elif what == "temperature":
        actor.compute_log_probs(b, 0.0)
    elif what == "adv":
        actor.train_step(b, mask * -1.0, torch.ones(3), mask, None, 1.0)
    elif what == "mask":
        actor.train_step(b, mask * -1.0, adv, mask[:, : W - 1], None, 1.0)
    elif what == "minibatches":
        job.actor.ppo_mini_batches = 5
        actor.train_step(b, mask * -1.0, adv, mask, None, 1.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what,msg", [
    ("vocab", r"RolloutBatch.tokens\[0, 2\] = 387 is outside the model vocabulary \[0, 384\)"),
    ("temperature", "temperature must be > 0"),
    ("adv", r"advantages has shape \(3,\), expected \[4\] or \[4, \d+\]"),
    ("mask", r"response_mask has shape \(4, \d+\), expected \[B, L-1\]"),
    ("minibatches", "cannot split 4 rows of this DP shard over actor.ppo_mini_batches into 5"),
])
def test_bad_input_is_named(models, what, msg):
    with pytest.raises(RankError, match=msg):
        run_ranks(_rank_bad, 1, named_job("actor", hf=models["qwen2"]), what, timeout=100)
