"""EmbeddedEngine's shortcuts compute what the straightforward computation computes.

The engine prefills each distinct prompt once and copies its KV cache and logits to the prompt's ``n`` rows, and
draws each row's sampling noise several steps per call (``NoiseBlocks``). The reference here is the
straightforward generation loop, written out below from the public pieces: every row padded and prefilled on
its own, one ``exponential_noise`` draw per step on per-row generators, a row ending at a stop id or at
``max_new_tokens``. The models run in float64 here, so that a matrix product's rounding in one batch shape or
another (which CPU kernels do not promise to keep: a row's result may depend on how many rows the batch has)
cannot decide the outcome: tokens, finish reasons and matched stops must be equal, log-probs equal to 1e-6 (they
are float32). A wrong cache row, noise row or stop bookkeeping changes tokens. In bfloat16 at the quickstart's
sizes the engine's rollouts were also equal bit for bit on the development machine (the quickstart's metrics over
40 steps unchanged) -- a property of that CPU's kernels, not asserted here.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_embedded_engine_exact.py -q``
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.embedded import EmbeddedEngine
from megatron_rl.rollout.embedded_sampling import (
    NoiseBlocks,
    exponential_noise,
    row_seed,
    sample_next_tokens,
    sampled_logprobs,
)


@torch.no_grad()
def reference_generate(engine: EmbeddedEngine, prompts, sp: SamplingParams, n: int, seed: int):
    """``(response_ids, log_probs, finish_reason, matched_stop)`` per row: every row prefilled, noise drawn per step."""
    occurrence: dict = {}
    rows = []
    for p in prompts:
        occ = occurrence.get(tuple(p), 0)
        occurrence[tuple(p)] = occ + 1
        rows += [(p, row_seed(seed, p, occ, j)) for j in range(n)]
    B, L = len(rows), max(len(p) for p, _ in rows)
    ids = torch.full((B, L), engine.pad_token_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for r, (p, _) in enumerate(rows):
        ids[r, L - len(p):] = torch.tensor(p)
        mask[r, L - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    gens = [torch.Generator().manual_seed(s) for _, s in rows]
    stops = set(sp.stop_token_ids) | set(engine.eos_token_ids)
    out = engine.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
    logits, last = out.logits[:, -1, :], pos[:, -1]
    result = [[[], [], None, None] for _ in range(B)]
    for step in range(sp.max_new_tokens):
        nxt = sample_next_tokens(logits, sp.temperature, sp.top_k, sp.top_p, exponential_noise(gens, logits.shape[-1]))
        lp = sampled_logprobs(logits, nxt, sp.temperature)
        for r, res in enumerate(result):
            if res[2] is None:
                res[0].append(int(nxt[r]))
                res[1].append(float(lp[r]))
                if int(nxt[r]) in stops:
                    res[2], res[3] = "stop", int(nxt[r])
                elif len(res[0]) == sp.max_new_tokens:
                    res[2] = "length"
        done = torch.tensor([res[2] is not None for res in result])
        if bool(done.all()):
            break
        feed = torch.where(done, torch.full_like(nxt, engine.pad_token_id), nxt).unsqueeze(-1)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
        last = last + 1
        out = engine.model(input_ids=feed, attention_mask=mask, position_ids=last.unsqueeze(-1),
                           past_key_values=out.past_key_values, use_cache=True)
        logits = out.logits[:, -1, :]
    return [tuple(res) for res in result]


def engine_rows(rollouts):
    return [(r.response_ids, r.rollout_log_probs, r.finish_reason, r.info.get("matched_stop")) for r in rollouts]


@pytest.mark.parametrize("which", ["copy", "bpe"])
def test_shared_prefill_equals_per_row_generation(which, copy_model, dense_model):
    if which == "copy":
        path = copy_model
        # the quickstart's prompts: "copy:<digits>=" -- a prompt drawn twice, different lengths, 8 samples each
        prompts = [[17, 13, 4, 5, 6, 14], [17, 13, 10, 14], [17, 13, 4, 5, 6, 14], [17, 13, 7, 8, 14]]
        n, stop = 8, (1, 5)  # EOS and the digit 2: rows stop at different steps
    else:
        path = dense_model
        prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6, 7], [40]]
        n, stop = 3, tuple(range(100, 228))  # about a third of the vocabulary stops a row
    engine = EmbeddedEngine(path, dtype="float32", seed=0)
    engine.model.to(torch.float64)  # see the module docstring
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (0.0, 1.0)):
        sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=6, stop_token_ids=stop)
        got = engine_rows(engine.generate(prompts, sp, n=n, seed=17))
        want = reference_generate(engine, prompts, sp, n, seed=17)
        assert [(r[0], r[2], r[3]) for r in got] == [(r[0], r[2], r[3]) for r in want], (which, temperature, top_p)
        for g, w in zip(got, want):
            assert len(g[1]) == len(w[1]) and max(abs(a - b) for a, b in zip(g[1], w[1])) < 1e-6, (g, w)
        assert len({r[2] for r in got}) == 2 or temperature == 0  # both finish reasons occur


@pytest.mark.parametrize("vocab", [5, 24, 1000])
def test_noise_blocks_equal_per_step_draws(vocab):
    seeds = [3, 99, 2**62 + 5]
    steps = 7
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    want = [exponential_noise(gens, vocab) for _ in range(steps)]
    for max_floats in (1, 3 * vocab * 3, 1 << 22):  # blocks of 1 step, 3 steps, all steps
        blocks = NoiseBlocks(seeds, vocab, steps, max_floats=max_floats)
        for t in range(steps):
            got = blocks.step(t)
            assert got.is_contiguous() and torch.equal(got, want[t]), (vocab, max_floats, t)
    blocks = NoiseBlocks(seeds, vocab, steps)
    with pytest.raises(ValueError, match="in order"):
        blocks.step(1)
