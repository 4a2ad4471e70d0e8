"""``critic.load_hf`` (verl's ``critic.model.path``): a HF value model's weights give the critic its body and head.

A tiny random Qwen2 is saved by HF transformers as ``Qwen2ForTokenClassification`` / ``Qwen2ForSequenceClassification``
with ``num_labels=1`` and a random ``score``; the critic's values at TP1, TP2 and PP2 equal the HF model's own forward
(token classification: ``logits[..., 0]``; sequence classification: its ``score`` on every position) in fp32.
A CausalLM gives the body and a fresh head; another class count or other shapes are refused naming the key.
"""
import pytest
import torch

import megatron.core  # noqa: F401
from megatron_rl.actor.critic import MegatronCritic
from megatron_rl.parallel import initialize_model_parallel
from megatron_rl.plan.job import JobPlan, PlanError, critic_spec
from megatron_rl.testing.actor_reference import policy_data
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.testing.jobs import knobs, named_job

transformers = pytest.importorskip("transformers")

CRITIC = ("algorithm.advantage_estimator=gae", "critic.enable=true")


@pytest.fixture(scope="module")
def body(tiny_hf_model):
    return tiny_hf_model("qwen2", seed=31, num_hidden_layers=2)


def _classifier(body, out, cls_name, num_labels=1, seed=7):
    """``body`` saved by transformers as ``cls_name`` with a random ``score`` (and bias where HF has one)."""
    cls = getattr(transformers, cls_name)
    model = cls.from_pretrained(body, num_labels=num_labels, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(model.score.weight.shape, generator=g) * 0.5)
        if model.score.bias is not None:
            model.score.bias.fill_(0.3)
    model.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def token_cls(body, tmp_path_factory):
    return _classifier(body, tmp_path_factory.mktemp("token_cls"), "Qwen2ForTokenClassification")


def _rank(rank, world, job, batch):
    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    return critic.compute_values(batch)


def _job(body, path, **layout):
    return named_job("actor_ppo", *CRITIC, f"critic.load_hf={path}", *knobs(**layout), hf=body)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("layout,world", [(dict(), 1), (dict(tp=2), 2), (dict(pp=2), 2)], ids=["tp1", "tp2", "pp2"])
def test_values_equal_hf_token_classification(body, token_cls, layout, world):
    job = _job(body, token_cls, **layout)
    batch, _, _, mask, _ = policy_data(job.model.vocab_size, 4, 0, prompt_len=(1, 6), response_len=(1, 8),
                                       reject_token=False)
    ref = transformers.Qwen2ForTokenClassification.from_pretrained(token_cls, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=batch.tokens).logits[..., 0][:, :-1]
    assert float(ref.score.bias.detach()) == pytest.approx(0.3)  # the bias is checked too
    for values in run_ranks(_rank, world, job, batch, timeout=150):
        torch.testing.assert_close(values * mask, want * mask, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(200)
def test_values_equal_hf_sequence_classification_score(body, tmp_path):
    """HF's sequence classifier has no score bias: the head's bias stays 0; every position's value is its score."""
    path = _classifier(body, tmp_path / "seq_cls", "Qwen2ForSequenceClassification")
    job = _job(body, path)
    batch, _, _, mask, _ = policy_data(job.model.vocab_size, 4, 1, prompt_len=(1, 6), response_len=(1, 8),
                                       reject_token=False)
    ref = transformers.Qwen2ForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref.score(ref.model(input_ids=batch.tokens).last_hidden_state)[..., 0][:, :-1]
    [values] = run_ranks(_rank, 1, job, batch, timeout=150)
    torch.testing.assert_close(values * mask, want * mask, rtol=1e-4, atol=1e-5)


def test_causal_lm_gives_the_body_and_a_fresh_head_said(body):
    spec = critic_spec(_job(body, body))
    assert spec.weights.head is None and spec.weights.key == "critic.load_hf"
    assert "starts fresh" in spec.weights.line()
    default = critic_spec(named_job("actor_ppo", *CRITIC, hf=body))  # null: actor.load_hf (verl's default)
    assert default.weights.key == "actor.load_hf" and default.weights.path == body


def test_classifier_is_said_at_start(body, token_cls):
    spec = critic_spec(_job(body, token_cls))
    assert spec.weights.head == "Qwen2ForTokenClassification"
    lines = JobPlan.build(_job(body, token_cls), 1).describe()
    assert any(line.startswith("critic weights: body and value head from critic.load_hf") for line in lines)


def test_two_labels_refused_naming_the_key(body, tmp_path):
    path = _classifier(body, tmp_path / "two", "Qwen2ForTokenClassification", num_labels=2)
    with pytest.raises(PlanError, match=r"critic.load_hf: .*num_labels = 2"):
        critic_spec(_job(body, path))


def test_other_shapes_refused_naming_the_key(body, tiny_hf_model, tmp_path):
    other = tiny_hf_model("qwen2", seed=31, num_hidden_layers=3)
    path = _classifier(other, tmp_path / "deeper", "Qwen2ForTokenClassification")
    with pytest.raises(PlanError, match=r"critic.load_hf: .*num_layers"):
        critic_spec(_job(body, path))
    with pytest.raises(PlanError, match=r"critic.load_hf: .*not a directory"):
        critic_spec(_job(body, str(tmp_path / "missing")))


def _head_main_rank(rank, world, job, _):
    """(bf16 head weight, its fp32 main parameter in megatron's mixed-precision optimizer)."""
    from megatron_rl.actor.chained import sub_optimizers

    initialize_model_parallel(job.parallel, seed=5, model=job.model)
    critic = MegatronCritic(critic_spec(job))
    w = critic.model[-1].module.output_layer.weight
    [main] = [m for o in sub_optimizers(critic.optimizer) for mg, fg in zip(o.float16_groups,
                                                                            o.fp32_from_float16_groups)
              for p, m in zip(mg, fg) if p is w]
    return w.detach().clone(), main.detach().clone()


@pytest.mark.timeout(200)
def test_bf16_head_keeps_the_fp32_score_in_its_main_parameter(body, token_cls):
    """actor.bf16: the head's weight is the score rounded to bf16, its fp32 main parameter the score exactly."""
    job = _job(body, token_cls, bf16=True, use_distributed_optimizer=False)
    [(w, main)] = run_ranks(_head_main_rank, 1, job, None, timeout=150)
    score = transformers.Qwen2ForTokenClassification.from_pretrained(token_cls, dtype=torch.float32).score.weight
    assert w.dtype == torch.bfloat16 and main.dtype == torch.float32
    torch.testing.assert_close(main, score.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w, score.detach().to(torch.bfloat16), rtol=0, atol=0)
