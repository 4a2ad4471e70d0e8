"""What the docs and shipped configs say about multi-turn rows and routing metrics is what the code does.

* ``check`` plans a multi-turn job's rows as prompt + the key ``ops.memory.longest_row`` reports
  (``multi_turn.max_total_tokens``): every sentence of docs/multi_turn.md and of the Qwen3 tools config that says
  what ``check`` plans with names that key, not ``rollout.max_new_tokens``.
* ``rollout_corr/router_agreement*`` counts every position whose routing is replayed (``routing_valid_mask``:
  each token of a row but its last, prompt positions included): docs/routing_replay.md says so.
"""
import os
import re

import torch

from megatron_rl.actor.routing import agreement_counts, routing_valid_mask
from megatron_rl.plan import load_job_config
from megatron_rl.ops.memory import longest_row
from megatron_rl.plan.job import plan_parts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "configs", "qwen3_30b_a3b_tools_2x8.yaml")


def _read(*parts):
    with open(os.path.join(ROOT, *parts)) as fh:
        return fh.read()


def _sentences_about_check(text):
    """The sentences (or comment blocks, newlines folded) that say what `check` sizes / plans rows with."""
    flat = re.sub(r"\s*\n\s*#?\s*", " ", text)
    return [s for s in re.split(r"(?<=[.;:])\s+", flat)
            if re.search(r"check`? (sizes|plans)", s) and "token" in s]


def test_check_plans_multi_turn_rows_with_the_key_the_docs_name():
    cfg = load_job_config(TOOLS, world_size=16)
    parts = plan_parts(cfg, 16)
    row = longest_row(parts.dims, parts.budget, prompt_length=100)
    assert row.response_source == "multi_turn.max_total_tokens"
    assert row.response == cfg.multi_turn.max_total_tokens
    for where, text in (("docs/multi_turn.md", _read("docs", "multi_turn.md")), ("the tools config", _read(TOOLS))):
        claims = _sentences_about_check(text)
        assert claims, f"{where}: no sentence says what check plans rows with"
        for s in claims:
            assert row.response_source in s, f"{where}: {s!r}"
            assert not re.search(r"prompt \+ `?rollout\.max_new_tokens", s), f"{where}: {s!r}"


def test_router_agreement_counts_prompt_positions_as_documented():
    lengths = torch.tensor([5, 3])                     # rows of prompt + response tokens
    valid = routing_valid_mask(lengths, 4)
    own = torch.zeros(2, 4, 1, 2, dtype=torch.int64)
    own[..., 1] = 1
    c = agreement_counts(own, own.clone(), valid)
    assert float(c["tokens"]) == (5 - 1) + (3 - 1)     # every position but each row's last, prompt included
    doc = re.sub(r"\s+", " ", _read("docs", "routing_replay.md"))
    claim = doc[doc.index("`rollout_corr/router_agreement`"):][:600]
    assert "prompt, model **and** environment tokens alike" in claim and "each token of a row but its last" in claim


def test_readme_and_cluster_doc_say_what_ran_on_a_gpu_and_what_has_not():
    """The one GPU run (an H200, one rank, megatron-core 0.19.2, no Transformer Engine / SGLang, a named commit) is
    reported, and so is what has not run on a GPU; no doc still says that nothing ran on one."""
    for name in ("README.md", "docs/cluster.md", "docs/limits.md"):
        text = re.sub(r"\s+", " ", _read(name))
        for stale in ("Nothing here has run on a GPU", "none of it has run on GPUs", "No GPU here"):
            assert stale not in text, (name, stale)
    for name in ("README.md", "docs/cluster.md"):
        text = re.sub(r"\s+", " ", _read(name))
        for fact in ("H200", "megatron-core 0.19.2", "31399e1", "Not yet run on a GPU", "several GPUs",
                     "Transformer Engine", "SGLang on a GPU"):
            assert fact in text, (name, fact)


def _flat(text):
    return re.sub(r"\s+", " ", text)


def test_bypass_batch_normalize_depends_on_the_cut_as_documented():
    """Bypass mode's ``rollout_is_batch_normalize`` divides by the mean weight of each micro-batch's kept tokens on
    its DP rank (``correction.in_loss``): the same rows cut into two micro-batches get other weights than as one,
    each half equal to the independent reference on that half alone. So no doc may say the bypass weights, or
    the loss, do not depend on the micro-batch cut / DP without naming that exception, and the batch
    normalisation's sentence says what the factor depends on."""
    from megatron_rl.actor import train_step
    from megatron_rl.correction import RolloutCorrectionConfig, correct_in_loss
    from megatron_rl.correction import in_loss
    from tests.correction_reference import make_batch, reference

    lt, lr, mask = make_batch(5, B=10, T=14, spread=0.5, empty_rows=(4,))
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5, rollout_is_batch_normalize=True,
                                  bypass_mode=True, loss_type="reinforce")
    whole = correct_in_loss(lt, lr, mask, cfg).weights.double()
    halves = []
    for rows in (slice(0, 5), slice(5, 10)):
        ref_w, _, _ = reference(lt[rows].double(), lr[rows].double(), mask[rows], **cfg.to_dict())
        got = correct_in_loss(lt[rows], lr[rows], mask[rows], cfg).weights.double()
        torch.testing.assert_close(got, torch.tensor(ref_w, dtype=torch.float64), rtol=2e-6, atol=1e-7)
        halves.append(got)
    assert not torch.allclose(torch.cat(halves), whole, rtol=1e-4, atol=0)   # the cut changes the weights

    docs = {"docs/concepts.md": _flat(_read("docs", "concepts.md")),
            "train_mini_batch": _flat(train_step.train_mini_batch.__doc__),
            "correction/in_loss.py": _flat(in_loss.__doc__)}
    for where, text in docs.items():
        for s in re.split(r"(?<=[.;:])\s+", text):
            if re.search(r"(not depend on|Neither changes)", s) and re.search(r"micro-batch|\bDP\b", s):
                assert "rollout_is_batch_normalize" in s, f"{where}: {s!r}"
    concepts = docs["docs/concepts.md"]
    claim = concepts[concepts.index("`rollout_is_batch_normalize` divides by the mean weight of the micro-batch"):]
    claim = claim[:claim.index("- **Other objectives**")]
    for part in ("DP size", "actor.max_tokens_per_micro_batch", "packing"):
        assert part in claim, claim
