"""``StepBatch``: the rows of a step as one unit -- its rollouts.jsonl records, its summary metrics against
direct formulas, and resume of async checkpoints (drained rollouts stored as plain fields, and those written
before the ``StepRollouts`` -> ``StepBatch`` rename)."""
import json
import pickle
import types

from megatron_rl.trainer.rollout_source import _fields, _resumed_rollouts
from megatron_rl.trainer.step_batch import StepBatch


def _batch():
    return StepBatch(prompt_ids=[[1, 2], [1, 2], [3], [3]], response_ids=[[5], [6, 7], [8, 9, 4], []],
                     rollout_log_probs=[[-0.1], [-0.2, -0.3], [-1.0, -2.0, -0.5], []], rewards=[1.0, 0.0, 0.5, -1.0],
                     weight_version="step-4", token_versions=[[4], [3, 4], [4, 4, 4], []],
                     metrics={"reward/failed": 1.0})


def test_summary_and_records_match_direct_formulas():
    b = _batch()
    s = b.summary(failed_frac=0.25)
    assert s["reward/mean"] == sum(b.rewards) / 4 and s["reward/max"] == 1.0 and s["reward/min"] == -1.0
    assert s["response_length/mean"] == (1 + 2 + 3 + 0) / 4 and s["response_length/max"] == 3
    assert s["reward/failed_frac"] == 0.25
    assert b.num_tokens == (2 + 1) + (2 + 2) + (1 + 3) + (1 + 0)
    recs = [json.loads(line) for line in b.records(7)]
    assert [r["response_ids"] for r in recs] == b.response_ids
    assert all(r["step"] == 7 and r["weight_version"] == "step-4" for r in recs)
    assert [r["token_versions"] for r in recs] == b.token_versions


def test_drained_rollouts_round_trip_as_plain_fields():
    b = _batch()
    saved = pickle.loads(pickle.dumps({"async_rollouts": {5: _fields(b)}, "async_schedule": (1, "finish")}))
    assert isinstance(saved["async_rollouts"][5], dict)  # no class reference in the checkpoint
    back = _resumed_rollouts(saved, types.SimpleNamespace(max_staleness=1, partial_rollout="finish"))
    assert back == {5: b}
    other = _resumed_rollouts(saved, types.SimpleNamespace(max_staleness=2, partial_rollout="finish"))
    assert other == {}  # another schedule: regenerated


def test_checkpoint_written_before_the_rename_resumes():
    """An async checkpoint of the previous version pickled ``rollout_phase.StepRollouts`` objects (without the
    fields added since); they must load and become the same StepBatch."""
    b = _batch()
    old = StepBatch(**_fields(b))
    fresh = {f for f in vars(old) if f not in ("prompt_ids", "response_ids", "rollout_log_probs", "rewards",
                                               "weight_version", "routing", "truncated", "metrics",
                                               "token_versions")}
    for name in fresh:  # fields the old class did not have
        delattr(old, name)
    raw = pickle.dumps({"async_rollouts": {3: old}, "async_schedule": (1, "finish")}, protocol=2)
    assert b"megatron_rl.trainer.step_batch\nStepBatch\n" in raw
    raw = raw.replace(b"megatron_rl.trainer.step_batch\nStepBatch\n", b"megatron_rl.trainer.rollout_phase\nStepRollouts\n")
    saved = pickle.loads(raw)
    back = _resumed_rollouts(saved, types.SimpleNamespace(max_staleness=1, partial_rollout="finish"))
    assert back == {3: b}
