"""Learnability demo: GRPO from scratch on a built-in digit task with the EmbeddedEngine, single process.

A tiny Qwen2 (``build_task_model``) is trained in fp32 with a plain torch Adam optimizer (NOT megatron) on
rollouts from the bf16 ``EmbeddedEngine``; the engine gets the trainer's weights after every step through
``update_weights_from_state_dict``. Loss: on-policy REINFORCE with GRPO advantages,
``-sum(A * logp_trainer) / #response tokens`` (token mean), temperature 1. It validates that the task is
learnable at this scale and explores settings for ``configs/tiny_cpu.yaml`` quickly; it prints one line per step
and a summary (JSON) at the end. Options beyond the defaults (all off by default, so the defaults reproduce the
original on-policy REINFORCE): ``--updates K`` (K optimizer steps per batch on mini-batches, PPO-clipped against
the batch's old policy, like ``actor.ppo_mini_batches``), ``--kl-coef`` (k3 KL to the initial model, like
``actor.policy_loss.kl_loss_coef``), ``--entropy-coef``, ``--warmup`` / ``--min-lr-ratio`` (linear warm-up,
cosine decay), ``--curriculum-steps`` and ``--heldout-frac`` (the task options of the same names; with a held-out
split the summary reports greedy exact copies on the held-out prompts) and ``--temperature``. The real job is
faster per step than this single-process demo on a busy machine; confirm choices with the real quickstart.

Run (2-4 minutes on 2 cores)::

    OMP_NUM_THREADS=1 python tools/embedded_grpo_demo.py --task copy --steps 200
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

import torch


def main(argv=None) -> dict:
    """Run the demo; return the summary dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="copy")
    p.add_argument("--min-digits", type=int, default=1)
    p.add_argument("--max-digits", type=int, default=3)
    p.add_argument("--no-partial-credit", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--prompts-per-step", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--estimator", default="grpo")
    p.add_argument("--engine-dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--no-std-norm", action="store_true", help="Dr. GRPO: advantages not divided by the group std")
    p.add_argument("--updates", type=int, default=1,
                   help="optimizer steps per rollout batch (mini-batches; > 1: PPO clip against the old policy)")
    p.add_argument("--clip-ratio", type=float, default=0.2)
    p.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the initial model")
    p.add_argument("--entropy-coef", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=0, help="linear lr warm-up steps")
    p.add_argument("--min-lr-ratio", type=float, default=1.0, help="cosine decay to lr * this at the last step")
    p.add_argument("--curriculum-steps", type=int, default=0,
                   help="max digits ramps from min-digits to max-digits over this many steps")
    p.add_argument("--heldout-frac", type=float, default=0.0,
                   help="keep this fraction of strings out of training; greedy exact match on them at the end")
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(1)

    import transformers
    from transformers import AutoModelForCausalLM

    from megatron_rl.algo import compute_advantages
    from megatron_rl.rollout.base import SamplingParams
    from megatron_rl.rollout.embedded import EmbeddedEngine
    from megatron_rl.tasks import build_task, build_task_model

    transformers.utils.logging.disable_progress_bar()
    tmp = tempfile.mkdtemp(prefix="grpo_demo_")
    path = build_task_model(os.path.join(tmp, "model"), task=a.task, seed=a.seed, hidden_size=a.hidden_size,
                            num_layers=a.num_layers)
    torch.manual_seed(a.seed)
    actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    actor.train()
    engine = EmbeddedEngine(path, dtype=a.engine_dtype, seed=a.seed, weight_version="0")
    task = build_task(a.task, engine_tokenizer(path), task_kwargs=dict(
        min_digits=a.min_digits, max_digits=a.max_digits, partial_credit=not a.no_partial_credit,
        heldout_frac=a.heldout_frac))
    opt = torch.optim.Adam(actor.parameters(), lr=a.lr, betas=(0.9, a.beta2))
    ref = None
    if a.kl_coef > 0:
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    rng = random.Random(a.seed)
    sampling = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens)
    pad = engine.pad_token_id
    curve = []
    t_start = time.time()
    for step in range(1, a.steps + 1):
        t0 = time.time()
        for g in opt.param_groups:
            g["lr"] = a.lr * lr_factor(step, a.steps, a.warmup, a.min_lr_ratio)
        if a.curriculum_steps:
            task.max_digits = min(a.max_digits, a.min_digits + (a.max_digits - a.min_digits + 1) * (step - 1)
                                  // a.curriculum_steps)
        prompts = task.sample(a.prompts_per_step, rng)
        rollouts = engine.generate([pr.prompt_ids for pr in prompts], sampling, n=a.n)
        rewards = torch.tensor([task.reward(prompts[r.prompt_index], r.response_ids) for r in rollouts])
        exact = sum(1 for r, ro in zip(rewards.tolist(), rollouts) if r == 1.0) / len(rollouts)
        t_gen = time.time() - t0
        # Right-padded [prompt + response] batch; response tokens are the positions to score.
        seqs = [ro.prompt_ids + ro.response_ids for ro in rollouts]
        L = max(len(s) for s in seqs)
        T = max(len(ro.response_ids) for ro in rollouts)
        ids = torch.full((len(seqs), L), pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), L), dtype=torch.long)
        resp_mask = torch.zeros((len(seqs), T))
        for i, (s, ro) in enumerate(zip(seqs, rollouts)):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = 1
            resp_mask[i, :len(ro.response_ids)] = 1
        rollout_lp = torch.nn.utils.rnn.pad_sequence([torch.tensor(ro.rollout_log_probs) for ro in rollouts],
                                                     batch_first=True)[:, :T]
        adv = compute_advantages(rewards, [ro.prompt_index for ro in rollouts], resp_mask, estimator=a.estimator,
                                 norm_adv_by_std=not a.no_std_norm)
        with torch.no_grad():
            old_lp, _ = response_logprobs(actor, ids, attn, rollouts, T, a.temperature)
            ref_lp = response_logprobs(ref, ids, attn, rollouts, T, a.temperature)[0] if ref is not None else None
        blocks = torch.arange(len(seqs)).chunk(a.updates)
        for rows in blocks:
            lp, ent = response_logprobs(actor, ids[rows], attn[rows], [rollouts[i] for i in rows.tolist()], T,
                                        a.temperature)
            m, A = resp_mask[rows], adv[rows]
            ratio = torch.exp(lp - old_lp[rows])
            pg = -torch.min(ratio * A, ratio.clamp(1 - a.clip_ratio, 1 + a.clip_ratio) * A)
            per_tok = pg - a.entropy_coef * ent
            if ref_lp is not None:
                d = ref_lp[rows] - lp
                per_tok = per_tok + a.kl_coef * (torch.exp(d) - d - 1)
            loss = (per_tok * m).sum() / m.sum()
            opt.zero_grad()
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(actor.parameters(), a.clip_grad if a.clip_grad > 0 else 1e9)
            opt.step()
        ntok = resp_mask.sum()
        entropy = (ent.detach() * m).sum() / m.sum()
        mismatch = ((old_lp - rollout_lp).abs() * resp_mask).sum() / ntok
        engine.update_weights_from_state_dict(actor.state_dict(), version=str(step))
        rec = dict(step=step, reward=round(rewards.mean().item(), 4), exact=round(exact, 4),
                   resp_len=round(resp_mask.sum(-1).mean().item(), 2), loss=round(loss.item(), 5),
                   grad_norm=round(float(gnorm), 4), abs_logp_diff=round(mismatch.item(), 5),
                   entropy=round(entropy.item(), 4), lr=a.lr * lr_factor(step, a.steps, a.warmup, a.min_lr_ratio),
                   t_gen=round(t_gen, 3), t_step=round(time.time() - t0, 3))
        curve.append(rec)
        if not a.quiet:
            print(json.dumps(rec), flush=True)
    tok = task.tokenizer
    samples = [f"{prompts[ro.prompt_index].text} -> {tok.decode(ro.response_ids)!r} r={rw:.2f}"
               for ro, rw in list(zip(rollouts, rewards.tolist()))[::max(1, len(rollouts) // 12)]]
    if not a.quiet:
        print("last-step samples:\n  " + "\n  ".join(samples))
    k = max(1, len(curve) // 10)
    summary = dict(args=vars(a), last_step_samples=samples, first10_reward=sum(c["reward"] for c in curve[:k]) / k,
                   last10_reward=sum(c["reward"] for c in curve[-k:]) / k,
                   first10_exact=sum(c["exact"] for c in curve[:k]) / k,
                   last10_exact=sum(c["exact"] for c in curve[-k:]) / k,
                   seconds=round(time.time() - t_start, 1),
                   curve_reward_per_10_steps=[round(sum(c["reward"] for c in curve[i:i + 10]) / len(curve[i:i + 10]), 3)
                                              for i in range(0, len(curve), 10)],
                   curve_exact_per_10_steps=[round(sum(c["exact"] for c in curve[i:i + 10]) / len(curve[i:i + 10]), 3)
                                             for i in range(0, len(curve), 10)])
    q = curve[len(curve) - max(1, len(curve) // 4):]
    summary["last_quarter_reward"] = round(sum(c["reward"] for c in q) / len(q), 4)
    summary["last_entropy"] = curve[-1]["entropy"]
    if a.heldout_frac > 0:
        task.max_digits = a.max_digits
        held = task.heldout_prompts()
        greedy = engine.generate([pr.prompt_ids for pr in held], SamplingParams(temperature=0.0,
                                 max_new_tokens=a.max_new_tokens), n=1)
        summary["heldout_prompts"] = len(held)
        summary["heldout_greedy_exact"] = round(
            sum(task.reward(held[r.prompt_index], r.response_ids) == 1.0 for r in greedy) / len(held), 4)
    print("SUMMARY " + json.dumps(summary), flush=True)
    return summary


def lr_factor(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``steps`` (1-based step)."""
    import math

    if warmup and step <= warmup:
        return step / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def response_logprobs(model, ids, attn, rollouts, width: int, temperature: float):
    """(log-probs, entropies) ``[B, width]`` of each rollout's response tokens under softmax(logits / T)."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float() / (temperature or 1.0)
    logp_all = torch.log_softmax(logits, dim=-1)
    ent_all = -(logp_all.exp() * logp_all).sum(-1)
    lps, ents = [], []
    for i, ro in enumerate(rollouts):
        P, R = len(ro.prompt_ids), len(ro.response_ids)
        pos = torch.arange(P - 1, P - 1 + R)
        lps.append(logp_all[i, pos, torch.tensor(ro.response_ids)])
        ents.append(ent_all[i, pos])
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(lps, batch_first=True)[:, :width], pad(ents, batch_first=True)[:, :width]


def engine_tokenizer(path):
    """The task model's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


if __name__ == "__main__":
    main()
