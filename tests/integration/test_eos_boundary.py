"""EOS exactly at a segment boundary, with EOS sampling on (``ignore_eos=False``): a response that ends in EOS is
finished ("stop") and is never continued by async interrupt mode (issue 20, item 1).

The reference is the model's own EOS id, read independently from the checkpoint's ``config.json``: after an
EOS no response may hold another token, and a response that ends in EOS has finish reason "stop".

* the embedded engine: an EOS sampled as the last allowed token is "stop" (not "length");
* ``SegmentedEngine`` (interrupt mode, 1-token segments) over the embedded engine and over a real SGLang server:
  no response goes on after an EOS, and rows that hit EOS at a boundary exist (the test can see the defect);
* the SGLang client turns a "length" reply whose last token is a stop id into "stop";
* the RL loop (tiny_cpu, ``rollout.mode=async rollout.partial_rollout=interrupt rollout.segment_tokens=1
  trainer.dump_rollouts=true``, 2 steps): zero dumped responses continue after an EOS (the issue measured
  57 of 512).
"""
import json
import os

import pytest

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.sglang_server import sglang_available
from megatron_rl.testing.distributed import run_ranks
from megatron_rl.trainer.async_rollout import SegmentedEngine

PROMPTS = [[17, 13] + [3 + d] * k + [14] for d in range(10) for k in (1, 2, 3)]   # "copy:<digits>="


@pytest.fixture(scope="module")
def model_dir(task_model):
    return task_model(task="copy", seed=0, hidden_size=64, num_layers=2)


def _eos(model_dir):
    with open(os.path.join(model_dir, "config.json")) as fh:
        return int(json.load(fh)["eos_token_id"])


def _after_eos(responses, eos):
    """Responses holding a token after an EOS."""
    return [r for r in responses if eos in r[:-1]]


def test_embedded_eos_as_last_allowed_token_is_stop(model_dir):
    eos = _eos(model_dir)
    engine = EmbeddedEngine(model_dir, dtype="bfloat16", seed=0, weight_version="step-0")
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=1), n=16, seed=3)
    at_limit = [r for r in out if r.response_ids == [eos]]
    assert at_limit, "no row sampled EOS as its only allowed token: the test cannot see the defect"
    assert {r.finish_reason for r in at_limit} == {"stop"}
    assert all(r.info.get("matched_stop") == eos for r in at_limit)
    assert {r.finish_reason for r in out if r.response_ids != [eos]} == {"length"}


def _check_segmented(view, eos, sampling, n, **kw):
    out = view.generate(PROMPTS, sampling, n=n, **kw)
    responses = [list(r.response_ids) for r in out]
    # rows whose EOS came exactly at a segment boundary (every position is one with 1-token segments)
    bad = _after_eos(responses, eos)
    assert not bad, f"{len(bad)} of {len(out)} responses go on after an EOS, e.g. {bad[:3]}"
    ended = [r for r in out if r.response_ids and r.response_ids[-1] == eos]
    assert len(ended) >= 3, f"only {len(ended)} rows ended in EOS: the test cannot see the defect"
    assert {r.finish_reason for r in ended} == {"stop"}
    assert all(len(r.response_ids) == sampling.max_new_tokens for r in out if r.finish_reason == "length")
    # one log-prob and one weight version per response token, whatever the finish reason became
    assert all(len(r.rollout_log_probs) == len(r.response_ids) == len(r.info["token_versions"]) for r in out)
    return out


def test_segmented_embedded_never_continues_after_eos(model_dir):
    eos = _eos(model_dir)
    engine = EmbeddedEngine(model_dir, dtype="bfloat16", seed=0, weight_version="step-0")
    view = SegmentedEngine(engine, 1, lambda: None)
    _check_segmented(view, eos, SamplingParams(temperature=1.0, max_new_tokens=4), n=8, seed=11)


_SGL_OK, _SGL_REASON = sglang_available()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not _SGL_OK, reason=_SGL_REASON)
def test_segmented_sglang_never_continues_after_eos(model_dir, copy_sglang_server):
    """The same with a real SGLang server (CPU, bf16; the copy model's server this pytest process shares) as the
    engine, asked for the task's EOS as a stop id (as the RL loop asks): both the server's finish reason and the
    client's are checked."""
    from megatron_rl.rollout.sglang_engine import RetryPolicy, SGLangEngine

    eos = _eos(model_dir)
    assert copy_sglang_server.model_dir == model_dir
    engine = SGLangEngine(copy_sglang_server.get().url, request_timeout=120,
                          retry=RetryPolicy(max_attempts=2, backoff_initial=0.5))
    try:
        engine.update_weights(model_dir, "step-0")   # whatever an earlier test left on the server
        view = SegmentedEngine(engine, 1, lambda: None)
        for stops in ((), (eos,)):   # the model's EOS alone, and EOS also requested as a stop id
            _check_segmented(view, eos, SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=stops),
                             n=8)
    finally:
        engine.close()


def test_sglang_reply_saying_length_for_an_eos_at_the_limit_is_parsed_as_stop():
    """A reply in the shape an SGLang scheduler that checks the length first sends (finish reason "length" with
    EOS as the last token; SGLang 0.5.23 itself puts EOS first, which the server test above checks) is a
    "stop" rollout for the client; with ``ignore_eos`` the EOS is an ordinary token and it stays "length"."""
    from megatron_rl.rollout.finish import stop_ids
    from megatron_rl.rollout.sglang_engine import parse_generate_response

    def reply(ids):
        return {"output_ids": ids, "meta_info": {
            "output_token_logprobs": [[-1.0, t, None] for t in ids], "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3, "weight_version": "v"}}

    eos = 1
    on = stop_ids(SamplingParams(max_new_tokens=2, stop_token_ids=(eos,)))
    off = stop_ids(SamplingParams(max_new_tokens=2, ignore_eos=True), eos_ids=(eos,))
    got = parse_generate_response([reply([5, eos]), reply([eos, 5])], [[3, 4, 5]], 2, "http://s", "v", stops=on)
    assert [(r.finish_reason, r.info.get("matched_stop")) for r in got] == [("stop", eos), ("length", None)]
    got = parse_generate_response([reply([5, eos])], [[3, 4, 5]], 1, "http://s", "v", stops=off)
    assert [r.finish_reason for r in got] == ["length"]


def _train(rank, world, cfg):
    from megatron_rl.trainer.loop import train

    train(cfg)


@pytest.mark.timeout(900)
def test_async_interrupt_loop_dumps_no_response_continued_after_eos(model_dir, tiny_job):
    """The issue's measurement: tiny_cpu, async interrupt, 1-token segments, 2 steps, dumped rollouts."""
    cfg = tiny_job("parallel.tensor_model_parallel_size=1", "parallel.pipeline_model_parallel_size=1",
                   "cluster.gpus_per_node=1", "rollout.mode=async", "rollout.partial_rollout=interrupt",
                   "rollout.segment_tokens=1", "trainer.steps=2", "trainer.dump_rollouts=true",
                   "trainer.progress=false", "trainer.save_interval=0", "data.prompts_per_step=32", model=model_dir)
    run_dir = cfg.trainer.run_dir
    run_ranks(_train, 1, cfg, timeout=840)
    with open(os.path.join(run_dir, "rollouts.jsonl")) as fh:
        recs = [json.loads(line) for line in fh]
    assert len(recs) == 2 * cfg.data.prompts_per_step * cfg.rollout.n_samples_per_prompt
    eos = _eos(model_dir)
    bad = _after_eos([r["response_ids"] for r in recs], eos)
    assert not bad, f"{len(bad)} of {len(recs)} dumped responses go on after an EOS, e.g. {bad[:3]}"
    ended = [r for r in recs if r["response_ids"] and r["response_ids"][-1] == eos]
    assert len(ended) >= 10, "too few EOS-terminated responses: the test cannot see the defect"
