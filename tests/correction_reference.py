"""Independent reference of the rollout correction (plain Python floats, per-sequence loops) and the
batch generator / comparison helpers of the ``tests/*/test_correction_*.py`` files.

Written from the metric reference in ``megatron_rl/correction/finalize.py`` (module docstring) and the
documented decisions of ``megatron_rl.correction`` (per-sequence metrics over valid sequences, batch
normalisation over the tokens / sequences kept after rejection, k1 bounds on r = pi_train / pi_rollout,
empty sets -> 0.0). It shares no code with the implementation: thresholds are parsed again here. KPop's
``binary_kl`` statistic is ``areal_binary_kl`` below: AReaL's ``compute_binary_kl_divergence`` and the
``binary_kl`` branch of ``apply_rejection_sampling`` (areal/utils/functional/functional.py at commit
13353cc6767b7e47d45eed5fd87a0a6e669a246c, PR #1405) transcribed in float64.

Tolerances, per input dtype (``check_against_reference``): the implementation keeps per-token values
in float32 for float32 log-probs (sums in float64), so a metric that is a difference of O(1) values
(|w_s - 1|, chi^2 = E[r^2] - 1) carries ~1 float32 ulp of absolute error: atol 1e-7 for float32 inputs,
1e-9 for float64 inputs; rtol 1e-6 for both; a standard deviation sqrt(E[x^2] - E[x]^2) of float32
values may instead match in variance to 1e-6 absolute. Weights (returned in float32): rtol 2e-6 for float32
inputs, 1e-7 (the float32 rounding of the output) for float64 inputs.
"""
import math
import statistics

import torch

B20 = 20.0


def clamp(x, lo=-B20, hi=B20):
    return max(lo, min(hi, x))


def sexp(x):
    return math.exp(clamp(x))


def avg(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def ext(xs, fn):
    xs = list(xs)
    return fn(xs) if xs else 0.0


def parse_is(spec):
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_")
        return float(lo), float(hi), True
    c = float(spec)
    return 1.0 / c, c, False


def parse_rs(options, spec):
    parts = [p.strip() for p in str(spec).split(",")] if isinstance(spec, str) else [spec]
    if len(parts) == 1:
        parts = parts * len(options)
    out = {}
    for opt, p in zip(options, parts):
        if opt.endswith("k1"):
            if isinstance(p, str) and "_" in p:
                lo, hi = (float(x) for x in p.split("_"))
            else:
                hi = float(p)
                lo = 1.0 / hi
            out[opt] = ("k1", lo, hi)
        else:
            out[opt] = (opt[-2:], None, float(p))
    return out


def areal_binary_kl(log_p, log_q, eps=1e-8):
    """AReaL's ``compute_binary_kl_divergence`` (commit 13353cc6), one token, float64."""
    p = min(max(math.exp(log_p), eps), 1.0 - eps)
    q = min(max(math.exp(log_q), eps), 1.0 - eps)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def areal_kpop_metric(log_prox, log_behave):
    """The ``binary_kl`` metric of AReaL's ``apply_rejection_sampling``: max of forward and reverse; a token is
    kept iff it is <= upper (``_check_bounds`` without lower)."""
    return max(areal_binary_kl(log_prox, log_behave), areal_binary_kl(log_behave, log_prox))


def bad_value(x):
    return not math.isfinite(x) or x > 1e-3


def reference(lt, lr, mask, rollout_is=None, rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
              rollout_rs=None, rollout_rs_threshold=None, rollout_token_veto_threshold=None,
              on_invalid="raise", **_ignored):
    """Returns (weights [B][T] or None, final mask [B][T] of 0/1, metrics dict without prefix)."""
    lt, lr, mask = lt.tolist(), lr.tolist(), mask.tolist()
    Bn = len(mask)
    Tn = len(mask[0]) if Bn else 0
    rs_opts = [o.strip() for o in rollout_rs.split(",")] if rollout_rs else []
    rs_opts = list(dict.fromkeys(rs_opts))
    rsb = parse_rs(rs_opts, rollout_rs_threshold) if rs_opts else {}
    M = {}
    n_invalid_tok = 0
    n_invalid_seq = 0
    seqs = []  # (b, [token indices]) of valid sequences
    for b in range(Bn):
        toks = [t for t in range(Tn) if mask[b][t]]
        bad = [t for t in toks if bad_value(lt[b][t]) or bad_value(lr[b][t])]
        n_invalid_tok += len(bad)
        if bad:
            n_invalid_seq += 1
            if on_invalid == "raise":
                raise ValueError("invalid")
            continue
        if toks:
            seqs.append((b, toks))
    all_tok = [(b, t) for b, toks in seqs for t in toks]
    N, NS = len(all_tok), len(seqs)
    d = {(b, t): lt[b][t] - lr[b][t] for b, t in all_tok}
    dc = {k: clamp(v) for k, v in d.items()}
    stat = {
        "k1": {k: -v for k, v in dc.items()},
        "k2": {k: 0.5 * v * v for k, v in dc.items()},
        "k3": {k: math.exp(v) - 1.0 - v for k, v in dc.items()},
        "kl": {(b, t): areal_kpop_metric(lt[b][t], lr[b][t]) for b, t in all_tok},  # binary_kl (KPop)
    }
    S = {b: sum(d[(b, t)] for t in toks) for b, toks in seqs}
    Gm = {b: S[b] / len(toks) for b, toks in seqs}

    # ---- off-policy
    mt = {b: avg(lt[b][t] for t in toks) for b, toks in seqs}
    mr = {b: avg(lr[b][t] for t in toks) for b, toks in seqs}
    diff = {b: mr[b] - mt[b] for b in mt}
    M.update({
        "valid_token_count": N, "valid_seq_count": NS, "invalid_token_count": n_invalid_tok,
        "invalid_seq_count": n_invalid_seq,
        "training_log_ppl": avg(-mt[b] for b in mt), "training_ppl": avg(sexp(-mt[b]) for b in mt),
        "rollout_log_ppl": avg(-mr[b] for b in mr), "rollout_ppl": avg(sexp(-mr[b]) for b in mr),
        "kl": avg(-d[k] for k in all_tok), "k3_kl": avg(math.exp(dc[k]) - dc[k] - 1 for k in all_tok),
        "log_ppl_diff": avg(diff.values()), "log_ppl_abs_diff": avg(abs(x) for x in diff.values()),
        "log_ppl_diff_max": ext(diff.values(), max), "log_ppl_diff_min": ext(diff.values(), min),
        "ppl_ratio": avg(sexp(x) for x in diff.values()),
        "chi2_token": avg(math.exp(2 * dc[k]) for k in all_tok) - 1 if N else 0.0,
        "chi2_seq": avg(math.exp(2 * clamp(S[b])) for b in S) - 1 if NS else 0.0,
    })

    # ---- IS
    w = raw = None
    if rollout_is is not None:
        lo, hi, is_mask = parse_is(rollout_is_threshold)

        def bound(x):
            if is_mask:
                return x if lo <= x <= hi else 0.0
            return min(x, hi)
        raw, w = {}, {}
        for b, toks in seqs:
            for t in toks:
                if rollout_is == "token":
                    r = math.exp(dc[(b, t)])
                elif rollout_is == "sequence":
                    r = sexp(S[b])
                else:
                    r = sexp(Gm[b])
                raw[(b, t)] = r
                w[(b, t)] = bound(r)
        wc = {k: clamp(v, 0.0, hi) for k, v in w.items()}
        mean_wc = avg(wc.values())
        M["rollout_is_mean"] = avg(w.values())
        M["rollout_is_std"] = math.sqrt(max(0.0, avg(v * v for v in wc.values()) - mean_wc ** 2)) if N > 1 else 0.0
        q = avg((v / (mean_wc + 1e-8)) ** 2 for v in wc.values())
        M["rollout_is_eff_sample_size"] = 1.0 / q if q > 0 else 0.0
        if rollout_is == "token":
            M["rollout_is_max"] = ext(w.values(), max)
            M["rollout_is_min"] = ext(w.values(), min)
            M["rollout_is_ratio_fraction_high"] = avg(1.0 if raw[k] > hi else 0.0 for k in all_tok)
            M["rollout_is_ratio_fraction_low"] = avg(1.0 if raw[k] < lo else 0.0 for k in all_tok)
        else:
            L = S if rollout_is == "sequence" else Gm
            M["rollout_is_max"] = math.exp(min(B20, max(L.values()))) if L else 0.0
            M["rollout_is_min"] = math.exp(min(L.values())) if L else 0.0
            M["rollout_is_ratio_fraction_high"] = avg(1.0 if L[b] > math.log(hi) else 0.0 for b in L)
            M["rollout_is_ratio_fraction_low"] = avg(1.0 if L[b] < math.log(lo) else 0.0 for b in L)
        if is_mask:
            M["rollout_is_oob_ratio"] = avg(1.0 if (raw[k] < lo or raw[k] > hi) else 0.0 for k in all_tok)
        s = {b: avg(w[(b, t)] for t in toks) for b, toks in seqs}
        rs_ = {b: avg(raw[(b, t)] for t in toks) for b, toks in seqs}
        M["rollout_is_seq_mean"] = avg(s.values())
        M["rollout_is_seq_std"] = statistics.stdev(s.values()) if len(s) > 1 else 0.0
        M["rollout_is_seq_max"] = ext(s.values(), max)
        M["rollout_is_seq_min"] = ext(s.values(), min)
        M["rollout_is_seq_max_deviation"] = ext((abs(x - 1) for x in s.values()), max)
        M["rollout_is_seq_fraction_high"] = avg(1.0 if x > hi else 0.0 for x in rs_.values())
        M["rollout_is_seq_fraction_low"] = avg(1.0 if x < lo else 0.0 for x in rs_.values())
        ratios = sorted(math.exp(dc[k]) for k in all_tok)
        M["_ratios_sorted"] = ratios

    # ---- RS
    keep = {k: True for k in all_tok}
    seq_rs_rejected = set()
    for opt in rs_opts:
        est, lo_r, hi_r = rsb[opt]
        if est == "k1":
            Ls, Us = -math.log(hi_r), -math.log(lo_r)
        else:
            Ls, Us = 0.0, hi_r
        st = stat[est]
        p = f"rollout_rs_{opt}"
        if opt.startswith("token_") or opt == "binary_kl":
            tok_stat = dict(st)
            v = {b: avg(st[(b, t)] for t in toks) for b, toks in seqs}
            okeep = {k: (Ls <= st[k] <= Us) if est == "k1" else (st[k] <= Us) for k in all_tok}
            M[p + "_max"] = ext(tok_stat.values(), max)
            M[p + "_min"] = ext(tok_stat.values(), min)
            M[p + "_fraction_high"] = avg(1.0 if x > Us else 0.0 for x in tok_stat.values())
            M[p + "_fraction_low"] = avg(1.0 if x < Ls else 0.0 for x in tok_stat.values()) if est == "k1" else 0.0
        else:
            v = {}
            for b, toks in seqs:
                vals = [st[(b, t)] for t in toks]
                v[b] = sum(vals) if opt.startswith("seq_sum") else (avg(vals) if opt.startswith("seq_mean") else max(vals))
            tok_stat = {(b, t): v[b] for b, toks in seqs for t in toks}
            okeep = {(b, t): ((Ls <= v[b] <= Us) if est == "k1" else (v[b] <= Us)) for b, toks in seqs for t in toks}
            M[p + "_max"] = ext(v.values(), max)
            M[p + "_min"] = ext(v.values(), min)
            M[p + "_fraction_high"] = avg(1.0 if x > Us else 0.0 for x in v.values())
            M[p + "_fraction_low"] = avg(1.0 if x < Ls else 0.0 for x in v.values()) if est == "k1" else 0.0
        M[p + "_mean"] = avg(tok_stat.values())
        scl = [clamp(x, Ls, Us) for x in tok_stat.values()]
        M[p + "_std"] = math.sqrt(max(0.0, avg(x * x for x in scl) - avg(scl) ** 2)) if N > 1 else 0.0
        M[p + "_seq_mean"] = avg(v.values())
        M[p + "_seq_std"] = statistics.stdev(v.values()) if len(v) > 1 else 0.0
        M[p + "_seq_max"] = ext(v.values(), max)
        M[p + "_seq_min"] = ext(v.values(), min)
        M[p + "_seq_max_deviation"] = ext((abs(x) for x in v.values()), max)
        M[p + "_seq_fraction_high"] = avg(1.0 if x > Us else 0.0 for x in v.values())
        if est == "k1":
            M[p + "_seq_fraction_low"] = avg(1.0 if x < Ls else 0.0 for x in v.values())
        M[p + "_masked_fraction"] = avg(0.0 if okeep[k] else 1.0 for k in all_tok)
        rej_seqs = {b for b, toks in seqs if any(not okeep[(b, t)] for t in toks)}
        M[p + "_seq_masked_fraction"] = len(rej_seqs) / NS if NS else 0.0
        seq_rs_rejected |= rej_seqs
        for k in all_tok:
            keep[k] = keep[k] and okeep[k]
    if rs_opts:
        M["rollout_rs_masked_fraction"] = avg(0.0 if keep[k] else 1.0 for k in all_tok)
        M["rollout_rs_seq_masked_fraction"] = len(seq_rs_rejected) / NS if NS else 0.0
    vetoed = set()
    if rollout_token_veto_threshold is not None:
        cat = {k for k in all_tok if d[k] < math.log(rollout_token_veto_threshold)}
        vetoed = {b for b, _ in cat}
        M["rollout_is_veto_fraction"] = len(vetoed) / NS if NS else 0.0
        M["rollout_is_catastrophic_token_fraction"] = len(cat) / N if N else 0.0
    final = [[0] * Tn for _ in range(Bn)]
    for (b, t) in all_tok:
        if keep[(b, t)] and b not in vetoed:
            final[b][t] = 1
    kept_seqs = [b for b, toks in seqs if any(final[b][t] for t in toks)]
    M["kept_token_count"] = sum(map(sum, final))
    M["kept_seq_count"] = len(kept_seqs)

    weights = None
    if rollout_is is not None:
        factor = 1.0
        if rollout_is_batch_normalize:
            if rollout_is == "token":
                mean = avg(w[(b, t)] for b in range(Bn) for t in range(Tn) if final[b][t])
            else:
                mean = avg(w[(b, [t for t in toks if final[b][t]][0])] for b, toks in seqs if b in kept_seqs)
            factor = mean if mean > 1e-8 else 1.0
            M["rollout_is_batch_norm_factor"] = factor
        weights = [[(w[(b, t)] / factor if final[b][t] else 0.0) for t in range(Tn)] for b in range(Bn)]
    return weights, final, M


PREFIX = "rollout_corr/"


def make_batch(seed, B=12, T=16, spread=0.3, empty_rows=(3,), extreme=True, pad_garbage=True):
    """Random rollout / train log-probs with right padding, empty rows and out-of-clamp ratios."""
    g = torch.Generator().manual_seed(seed)
    lr = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4.0
    lt = (lr + spread * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    for r in empty_rows:
        if r < B:
            mask[r] = 0
    if extreme and B > 1 and T > 1:
        lr[1, 0], lt[1, 0] = -45.0, -0.01   # log-ratio ~ +45: beyond the +-20 clamp
        lr[0, 1], lt[0, 1] = -0.02, -30.0   # log-ratio ~ -30
        mask[0, :2] = 1
        mask[1, 0] = 1
    if pad_garbage:  # padding may hold anything (NaN, inf, positive): it must be ignored
        lt = torch.where(mask.bool(), lt, torch.full_like(lt, float("nan")))
        lr = torch.where(mask.bool(), lr, torch.full_like(lr, 7.0))
    return lt.float(), lr.float(), mask


def check_against_reference(res, lt, lr, mask, cfg, rtol=1e-6, atol=None):
    """Compare a CorrectionResult with the independent reference (weights, mask, every metric).

    ``atol`` defaults per input dtype (module docstring)."""
    f64 = lt.dtype == torch.float64 and lr.dtype == torch.float64
    if atol is None:
        atol = 1e-9 if f64 else 1e-7
    w_rtol, w_atol = (1e-7, 1e-12) if f64 else (2e-6, 1e-7)  # weights are returned in float32
    ref_w, ref_mask, ref_m = reference(lt.double(), lr.double(), mask, **cfg.to_dict())
    assert res.response_mask.tolist() == [[float(x) for x in row] for row in ref_mask] or \
        res.response_mask.bool().tolist() == [[bool(x) for x in row] for row in ref_mask]
    if ref_w is None:
        assert res.weights is None
    else:
        assert res.weights.dtype == torch.float32 and not res.weights.requires_grad
        torch.testing.assert_close(res.weights.double(), torch.tensor(ref_w, dtype=torch.float64),
                                   rtol=w_rtol, atol=w_atol)
    ratios = ref_m.pop("_ratios_sorted", None)
    got = dict(res.metrics)
    for k, v in ref_m.items():
        key = PREFIX + k
        assert key in got, f"missing metric {key}"
        assert math.isfinite(got[key]), f"{key} = {got[key]}"
        # std = sqrt(E[x^2] - E[x]^2): the cancellation leaves ~sqrt(eps)*|x| absolute noise near 0;
        # with float32 per-token values (x ~ O(1)) the variance itself is good to ~1e-6 absolute
        tol = max(atol, 1e-6) if key.endswith("_std") else atol
        close = math.isclose(got[key], v, rel_tol=rtol, abs_tol=tol)
        if not close and key.endswith("_std") and not f64:
            close = abs(got[key] ** 2 - v ** 2) <= 1e-6
        assert close, f"{key}: got {got[key]!r}, reference {v!r}"
    extra = set(got) - {PREFIX + k for k in ref_m} - {PREFIX + f"rollout_is_p{q}" for q in (50, 90, 99)}
    assert not extra, f"metrics without reference: {sorted(extra)}"
    if ratios is not None:
        check_quantiles(got, ratios)
    return ref_m


def check_quantiles(metrics, ratios_sorted):
    """Histogram quantiles lie within the documented half-bin bound of the inverted-CDF quantile."""
    n = len(ratios_sorted)
    for q in (0.5, 0.9, 0.99):
        est = metrics[PREFIX + f"rollout_is_p{int(q * 100)}"]
        if n == 0:
            assert est == 0.0
            continue
        true = ratios_sorted[max(1, math.ceil(q * n - 1e-9)) - 1]
        lt = math.log(true)
        tol = 1e-3 * math.cosh(math.asinh(abs(lt) / 1e-3) + 5e-3) * 5e-3 / 2 + 1e-12
        assert abs(math.log(est) - lt) <= tol, f"p{int(q*100)}: {est} vs {true}"
