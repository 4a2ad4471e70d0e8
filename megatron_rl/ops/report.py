"""Run report: PNG plots and a Markdown health summary from ``RUN_DIR/metrics.jsonl``.

    megatron-rl report runs/qwen2.5_7b            # writes runs/qwen2.5_7b/report/{report.md,*.png}

Any metric may be missing (a plot is drawn when one of its keys exists); a step logged twice (a resumed run) keeps
its last record. Each health check judges the mean over the last quarter of the run unless it says otherwise;
the thresholds are module constants and report.md prints them. The plots, every check with its rule and
severity, and how the statuses are decided: docs/report.md.
"""
from __future__ import annotations

import fnmatch
import math
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_rl.config.sections import DataConfig
from megatron_rl.jsonl import read_json_objects

ESS_MIN = 0.5
VETO_MAX = 0.05
IS_MEAN_DEV_MAX = 0.2
RS_MASKED_MAX = 0.5
IS_P99_MAX = 10.0
K3_RISE_FACTOR = 2.0
K3_FLOOR = 1e-3
SOLVED_FRAC = 0.9
STALL_TREND = 0.05
MIN_ZERO_GRAD_STEPS = 3
ENTROPY_COLLAPSE = 0.1
REWARD_FLAT_RANGE = 0.01
REWARD_FAILED_FRAC_MAX = DataConfig.max_reward_failure_frac  # the trainer's default, one owner
MIN_STEPS = 8

P = "rollout_corr/"
# file name, title, panels (each panel: the keys drawn together on one axis)
PLOTS: List[Tuple[str, str, List[List[str]]]] = [
    ("reward_length.png", "Reward and response length", [["reward/mean"], ["response_length/mean"]]),
    ("mismatch_kl.png", "Rollout / training mismatch",
     [[P + "kl"], [P + "k3_kl"], [P + "chi2_token", P + "chi2_seq"]]),
    ("is_ratio.png", "IS weights: mean and token-ratio quantiles",
     [[P + "rollout_is_mean"], [P + "rollout_is_p50", P + "rollout_is_p90", P + "rollout_is_p99"]]),
    ("ess.png", "Effective sample size of the IS weights (normalised)", [[P + "rollout_is_eff_sample_size"]]),
    ("masked_fractions.png", "Rejected fractions",
     [[P + "rollout_rs_masked_fraction", P + "rollout_is_veto_fraction"]]),
    ("throughput.png", "Throughput and step time",
     [["perf/tokens_per_s"], ["timing/rollout_s", "timing/logprob_s", "timing/train_s"]]),
    ("actor.png", "Actor", [["actor/pg_loss"], ["actor/grad_norm"], ["actor/entropy"], ["actor/lr"]]),
    ("async.png", "Asynchronous rollouts: policy lag and overlap",
     [["rollout/staleness_mean", "rollout/staleness_max"], [P + "lag0_k3_kl", P + "lagged_k3_kl"],
      ["perf/rollout_overlap_frac"]]),
    ("routing.png", "MoE routing: trainer top-k equal to the rollout's", [[P + "router_agreement"]]),
    ("validation.png", "Validation set (never trained on): reward and response length",
     [["val/reward_mean", "val/*/reward_mean"], ["val/response_length_mean", "val/*/response_length_mean"]]),
]


#: y-axis label (with unit) of a panel, by the first key drawn on it
YLABELS: Dict[str, str] = {
    "reward/mean": "reward (mean)",
    "response_length/mean": "response length (tokens)",
    P + "kl": "kl (nats)",
    P + "k3_kl": "k3 kl (nats)",
    P + "chi2_token": "chi2",
    P + "rollout_is_mean": "mean IS weight",
    P + "rollout_is_p50": "token ratio pi_train / pi_rollout",
    P + "rollout_is_eff_sample_size": "ESS / N (fraction, 0..1)",
    P + "rollout_rs_masked_fraction": "fraction rejected (0..1)",
    P + "rollout_is_veto_fraction": "fraction vetoed (0..1)",
    "perf/tokens_per_s": "tokens / s",
    "timing/rollout_s": "seconds per step",
    "actor/pg_loss": "policy loss",
    "actor/grad_norm": "grad norm (before clipping)",
    "actor/entropy": "entropy (nats / token)",
    "actor/lr": "learning rate (mean of the step's updates)",
    "rollout/staleness_mean": "token lag (weight versions)",
    P + "lag0_k3_kl": "k3 kl (nats): current vs lagged tokens",
    "perf/rollout_overlap_frac": "generation during training (fraction of step time)",
    P + "router_agreement": "agreement (fraction of token x layer x k)",
    "val/reward_mean": "validation reward (mean)",
    "val/response_length_mean": "validation response length (tokens)",
}
#: metrics that are fractions: their panels are drawn on [0, 1] (a constant 0 is not blown up into noise)
FRACTIONS = frozenset({P + "rollout_is_eff_sample_size", P + "rollout_rs_masked_fraction",
                       P + "rollout_is_veto_fraction", "perf/rollout_overlap_frac", P + "router_agreement"})
#: async.png is drawn only for runs that were asynchronous: one of these is non-zero at some step
ASYNC_EVIDENCE = ("rollout/staleness_max", "rollout/staleness_mean", "perf/rollout_overlap_frac")
#: footnotes printed under a figure
NOTES: Dict[str, str] = {
    "async.png": "rollout.mode async: step t is generated from the weights after t - k steps (k = max_staleness); "
                 "lag-0 tokens show the precision mismatch alone, lagged tokens lag + precision.",
    "mismatch_kl.png": "kl = mean(log pi_rollout - log pi_train) and chi2 = E[ratio^2] - 1 are sample estimates: "
                       "they can be negative on a batch even though the true divergences are >= 0; k3 is >= 0 "
                       "per token.",
}
#: rows of report.md's "last" column: the mean of the last LAST_WINDOW steps (one step is noisy)
LAST_WINDOW = 10


class MetricsError(ValueError):
    """metrics.jsonl is missing or malformed (the message names the file and line)."""


@dataclass
class Finding:
    """One health-check result."""

    severity: str
    """"FAIL" (the run is unhealthy), "WARN" (look at it) or "INFO" (expected; said so that nobody wonders)."""
    check: str
    """Short name of the check."""
    message: str
    """What was measured against which threshold."""


# ----------------------------------------------------------------------------- reading
def read_metrics(path: str) -> List[dict]:
    """Records of a metrics.jsonl sorted by step (last record wins for a repeated step)."""
    if not os.path.isfile(path):
        raise MetricsError(f"{path} does not exist (is this a run directory?)")
    by_step: Dict[int, dict] = {}
    try:
        for no, rec in read_json_objects(path):
            step = rec.get("step")
            if isinstance(step, bool) or not isinstance(step, (int, float)) or int(step) != step:
                raise MetricsError(f"{path}:{no}: missing or non-integer 'step' ({step!r})")
            by_step[int(step)] = rec
    except MetricsError:
        raise
    except ValueError as exc:
        raise MetricsError(str(exc)) from None
    if not by_step:
        raise MetricsError(f"{path}: no records")
    return [by_step[s] for s in sorted(by_step)]


def series(records: Sequence[dict], key: str) -> Tuple[List[int], List[float]]:
    """(steps, values) of ``key`` over the records that have a numeric value for it."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        xs.append(int(r["step"]))
        ys.append(float(v))
    return xs, ys


def _finite(ys: Sequence[float]) -> List[float]:
    return [y for y in ys if math.isfinite(y)]


def _mean(ys: Sequence[float]) -> float:
    ys = _finite(ys)
    return sum(ys) / len(ys) if ys else float("nan")


def _quarter(ys: Sequence[float], last: bool) -> List[float]:
    k = max(1, len(ys) // 4)
    return list(ys[-k:] if last else ys[:k])


def quarter_means(records: Sequence[dict], key: str) -> Optional[Tuple[float, float]]:
    """(first-quarter mean, last-quarter mean) of ``key`` over the run, or None if it never appears."""
    _, ys = series(records, key)
    if not ys:
        return None
    return _mean(_quarter(ys, False)), _mean(_quarter(ys, True))


def _smooth(ys: Sequence[float], w: int) -> List[float]:
    out = []
    for i in range(len(ys)):
        win = ys[max(0, i - w + 1): i + 1]
        out.append(_mean(win))
    return out


#: The checks on one ``rollout_corr/`` key's last-quarter mean (rows of the module docstring's table):
#: (severity, check, key, is the mean unhealthy, the finding's message for that mean)
_LAST_QUARTER_RULES = (
    ("FAIL", "ESS", "rollout_is_eff_sample_size", lambda v: v < ESS_MIN,
     lambda v: f"rollout_is_eff_sample_size = {v:.3f} < {ESS_MIN} (last-quarter mean): a few sequences/tokens carry "
               "most of the IS weight"),
    ("FAIL", "veto fraction", "rollout_is_veto_fraction", lambda v: v > VETO_MAX,
     lambda v: f"rollout_is_veto_fraction = {v:.3f} > {VETO_MAX} (last-quarter mean): many sequences contain a "
               "catastrophic token"),
    ("FAIL", "mean IS weight", "rollout_is_mean", lambda v: abs(v - 1.0) > IS_MEAN_DEV_MAX,
     lambda v: f"|rollout_is_mean - 1| = {abs(v - 1):.3f} > {IS_MEAN_DEV_MAX} (mean {v:.3f}, last quarter): rollout "
               "and trainer disagree systematically (temperature, dtype, weight sync?)"),
    ("WARN", "RS masked fraction", "rollout_rs_masked_fraction", lambda v: v > RS_MASKED_MAX,
     lambda v: f"rollout_rs_masked_fraction = {v:.3f} > {RS_MASKED_MAX} (last quarter): most tokens are rejected"),
    ("WARN", "IS ratio tail", "rollout_is_p99", lambda v: v > IS_P99_MAX,
     lambda v: f"rollout_is_p99 = {v:.2f} > {IS_P99_MAX} (last quarter)"),
)


# ----------------------------------------------------------------------------- health
def health_checks(records: Sequence[dict]) -> List[Finding]:
    """Findings for the thresholds in the module docstring (empty list = healthy)."""
    out: List[Finding] = []
    keys = sorted({k for r in records for k in r if k not in ("step", "time")})
    bad = []
    for k in keys:
        xs, ys = series(records, k)
        for x, y in zip(xs, ys):
            if not math.isfinite(y):
                bad.append(f"{k} at step {x}")
                break
    if bad:
        out.append(Finding("FAIL", "non-finite metrics", "NaN/inf in " + ", ".join(bad[:8])
                           + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")))

    out += _reward_failure_findings(records)
    out += _filter_groups_findings(records)
    out += _stall_findings(records)

    for severity, check, key, unhealthy, message in _LAST_QUARTER_RULES:
        means = quarter_means(records, P + key)
        if means is not None and unhealthy(means[1]):
            out.append(Finding(severity, check, message(means[1])))
    _, k3 = series(records, P + "k3_kl")
    k3 = _finite(k3)
    if len(k3) >= MIN_STEPS:
        first, last = _mean(_quarter(k3, False)), _mean(_quarter(k3, True))
        if last > K3_FLOOR and last > K3_RISE_FACTOR * max(first, 0.0):
            out.append(Finding("WARN", "k3 KL rising", f"rollout_corr/k3_kl last-quarter mean {last:.3g} > "
                               f"{K3_RISE_FACTOR} x first-quarter mean {first:.3g}: the mismatch is growing"))
    _, rw = series(records, "reward/mean")
    rw = _finite(rw)
    if len(rw) >= MIN_STEPS:
        sm = _smooth(rw, max(1, len(rw) // 10))
        rng = max(sm) - min(sm)
        if rng < REWARD_FLAT_RANGE:
            out.append(Finding("WARN", "reward flat", f"smoothed reward/mean range {rng:.4f} < {REWARD_FLAT_RANGE} "
                               f"over {len(rw)} steps: no learning signal"))
    return out


def _reward_failure_findings(records: Sequence[dict]) -> List[Finding]:
    """FAIL when a step's failed + timed-out reward fraction exceeds REWARD_FAILED_FRAC_MAX, WARN when any
    reward failed (the failed samples were scored 0 and trained on)."""
    xs, fr = series(records, "reward/failed_frac")
    worst = max(((y, x) for x, y in zip(xs, fr) if math.isfinite(y)), default=None)
    if worst is not None and worst[0] > REWARD_FAILED_FRAC_MAX:
        return [Finding("FAIL", "failed rewards", f"reward/failed_frac = {worst[0]:.3f} > {REWARD_FAILED_FRAC_MAX} "
                        f"at step {worst[1]}: most rewards failed or timed out (scored 0) -- a missing reward "
                        "dependency, a reward function that raises, or data.reward_timeout_s too short")]
    counts = [(x, y) for key in ("reward/failed", "reward/timed_out")
              for x, y in zip(*series(records, key)) if math.isfinite(y) and y > 0]
    if counts:
        return [Finding("WARN", "failed rewards", f"{len({x for x, _ in counts})} step(s) had failed or timed-out "
                        f"rewards (first at step {min(x for x, _ in counts)}), scored 0")]
    return []


def sampled_reward(records: Sequence[dict]) -> Tuple[List[float], List[float], float, float]:
    """(steps, the sampled reward per step, its floor, its ceiling): ``reward/raw_mean`` (every generated sample)
    where dynamic sampling logged it -- its ``reward/mean`` covers the trained groups only --, else
    ``reward/mean``; floor and ceiling are those of the first of [0, 1], [-1, 0], [-1, 1] that holds every logged
    value, else the lowest and the highest value logged (the best possible reward is not known then)."""
    key = "reward/raw_mean" if any("reward/raw_mean" in r for r in records) else "reward/mean"
    xs, ys = series(records, key)
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    for lo, hi in ((0.0, 1.0), (-1.0, 0.0), (-1.0, 1.0)):   # the usual verifiable ranges (penalties: [-1, 0])
        if all(lo <= y <= hi for y in ys):
            return xs, ys, lo, hi
    return xs, ys, min(ys, default=0.0), max(ys, default=1.0)


def _solved(value: float, floor: float, ceiling: float) -> bool:
    """Within (1 - SOLVED_FRAC) of the reward's span below its ceiling (0.9 on a [0, 1] reward)."""
    return value >= ceiling - (1.0 - SOLVED_FRAC) * (ceiling - floor)


def _slope(ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` per step."""
    n = len(ys)
    mx, my = (n - 1) / 2, _mean(ys)
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den if den else 0.0


def _filter_groups_findings(records: Sequence[dict]) -> List[Finding]:
    """WARN when dynamic sampling ran out of rounds at some step (``filter_groups/exhausted``): the step trained
    groups without signal (advantage 0) to fill its batch, or was skipped (``filter_groups/skipped``); INFO when
    those steps' sampled reward says the groups score alike because they are solved."""
    steps = [x for x, y in zip(*series(records, "filter_groups/exhausted")) if y > 0]
    if not steps:
        return []
    skipped = [x for x, y in zip(*series(records, "filter_groups/skipped")) if y > 0]
    xs, ys, floor, ceiling = sampled_reward(records)
    at = [y for x, y in zip(xs, ys) if x in set(steps)]
    if at and _solved(_mean(at), floor, ceiling):
        return [Finding("INFO", "dynamic sampling exhausted",
                        f"{len(steps)} step(s) found too few prompt groups with reward signal (first at step "
                        f"{steps[0]}; {len(skipped)} skipped) while the sampled reward there was {_mean(at):.3f} "
                        f"(within {1 - SOLVED_FRAC:.1f} of its span [{floor:g}, {ceiling:g}] below the top): the "
                        f"groups score alike because they are solved -- expected once a task is learned")]
    return [Finding("WARN", "dynamic sampling exhausted",
                    f"{len(steps)} step(s) found too few prompt groups with reward signal in "
                    f"algorithm.filter_groups.max_num_gen_batches rounds (first at step {steps[0]}; {len(skipped)} "
                    f"skipped, the others topped up with groups of advantage 0): most groups score alike -- the "
                    f"task may be too easy or too hard for the model")]


def _stall_findings(records: Sequence[dict]) -> List[Finding]:
    """WARN "stalled" (see the module docstring): over the last quarter the reward has no upward trend left, below
    its top, and the policy stayed collapsed (entropy near zero throughout, or repeated steps without gradient)."""
    xs, ys, floor, ceiling = sampled_reward(records)
    if len(ys) < 2 * MIN_STEPS:
        return []
    tail = ys[-max(MIN_STEPS, len(ys) // 4):]   # the last quarter
    smooth = _smooth(ys, max(1, len(ys) // 10))
    span = max(smooth) - min(smooth)
    gained = _slope(tail) * len(tail)             # what the trend of the last quarter added over it
    last = _mean(tail)
    if _solved(last, floor, ceiling) or (span > 0 and gained >= STALL_TREND * span):
        return []
    _, ent = series(records, "actor/entropy")
    ent = _finite(ent)
    ent_tail = ent[-len(tail):] if ent else []
    gx, gn = series(records, "actor/grad_norm")
    zero = [x for x, g in zip(gx, gn) if g == 0.0 and x >= xs[-len(tail)]]
    collapsed = bool(ent_tail) and max(ent_tail) < ENTROPY_COLLAPSE
    if not (collapsed or len(zero) >= MIN_ZERO_GRAD_STEPS):
        return []
    why = [f"entropy below {ENTROPY_COLLAPSE} nats/token throughout (last {max(ent_tail):.3g} at most)"] if collapsed else []
    why += ([f"{len(zero)} step(s) with zero gradient (first at step {zero[0]})"]
            if len(zero) >= MIN_ZERO_GRAD_STEPS else [])
    return [Finding("WARN", "stalled",
                    f"over the last {len(tail)} steps the sampled reward sat at {last:.3f} with no upward trend (it "
                    f"gained {gained:+.3f}, against {span:.3f} over the run; top {ceiling:g}) and the policy "
                    f"collapsed: {'; '.join(why)}. More steps are unlikely to move it: see docs/quickstart.md (a "
                    f"collapse) -- a higher entropy bonus or KL to the initial model, a lower learning rate, or "
                    f"another seed")]


# ----------------------------------------------------------------------------- plots
def make_plots(records: Sequence[dict], out_dir: str) -> List[str]:
    """Write the PNGs whose keys exist; return their file names."""
    figures = build_figures(records)  # selects the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    written = []
    for fname, fig in figures:
        fig.savefig(os.path.join(out_dir, fname), dpi=110)
        plt.close(fig)
        written.append(fname)
    return written


def _healthy_is_band(ax) -> None:
    """The healthy band of the mean IS weight (1 +- IS_MEAN_DEV_MAX): filled where it ends inside the view;
    when the whole view lies inside it, a legend note instead of a panel filled edge to edge."""
    lo, hi = 1 - IS_MEAN_DEV_MAX, 1 + IS_MEAN_DEV_MAX
    y0, y1 = ax.get_ylim()
    if lo <= y0 and y1 <= hi:
        ax.plot([], [], " ", label=f"all inside the healthy band 1 +- {IS_MEAN_DEV_MAX}")
        return
    ax.axhspan(max(lo, y0), min(hi, y1), color="g", alpha=0.08, label=f"healthy mean: 1 +- {IS_MEAN_DEV_MAX}")
    for edge in (lo, hi):
        if y0 < edge < y1:
            ax.axhline(edge, color="g", lw=0.8, ls="--")
    ax.set_ylim(y0, y1)


def was_async(records: Sequence[dict]) -> bool:
    """Whether the run generated asynchronously: a token lag or an overlap above 0 at some step."""
    return any(y > 0 for k in ASYNC_EVIDENCE for y in _finite(series(records, k)[1]))


def expand_keys(keys: Sequence[str], records: Sequence[dict]) -> List[str]:
    """``keys`` with each pattern (``*``: e.g. ``val/*/reward_mean``, one line per data source) replaced by the
    matching keys of ``records``, sorted."""
    out: List[str] = []
    names = None
    for k in keys:
        if "*" not in k:
            out.append(k)
            continue
        if names is None:
            names = sorted({n for r in records for n in r})
        out += [n for n in names if fnmatch.fnmatchcase(n, k) and n not in keys]
    return out


def build_figures(records: Sequence[dict]):
    """(file name, matplotlib figure) of every plot whose keys exist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figures = []
    for fname, title, panel_keys in PLOTS:
        if fname == "async.png" and not was_async(records):
            continue  # a sync run: no lag, no overlap -- nothing to show
        panels = []
        for keys in panel_keys:
            present = [(k, *series(records, k)) for k in expand_keys(keys, records)]
            present = [(k, xs, ys) for k, xs, ys in present if xs]
            if present:
                panels.append(present)
        if not panels:
            continue
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 2.8 * len(panels)), sharex=True,
                                 squeeze=False)
        for ax, present in zip(axes[:, 0], panels):
            for k, xs, ys in present:
                ax.plot(xs, ys, label=k.replace(P, ""), marker="." if len(xs) < 60 else None, lw=1.2)
            ax.grid(alpha=0.3)
            keys = [k for k, _, _ in present]
            ax.set_ylabel(YLABELS.get(keys[0], keys[0].replace(P, "")), fontsize=8)
            if P + "rollout_is_mean" in keys:
                ax.axhline(1.0, color="k", lw=0.8, ls=":")
                vals = [y for _, _, ys in present for y in ys if math.isfinite(y)] + [1.0]
                pad = max(1e-4, 0.1 * (max(vals) - min(vals)))
                ax.set_ylim(min(vals) - pad, max(vals) + pad)   # zoom on the data, not on the band
                _healthy_is_band(ax)
            if P + "rollout_is_p99" in keys or P + "rollout_is_p50" in keys:
                ax.axhline(1.0, color="k", lw=0.8, ls=":")
                vals = [y for _, _, ys in present for y in ys if math.isfinite(y)]
                if vals and min(vals) > 0 and max(vals) / min(vals) > 20:
                    ax.set_yscale("log")
            if P + "rollout_is_eff_sample_size" in keys:
                ax.axhline(ESS_MIN, color="r", lw=1, ls="--", label=f"ESS_MIN = {ESS_MIN}")
            if all(k in FRACTIONS for k in keys):
                ax.set_ylim(0, 1)
            if P + "rollout_is_veto_fraction" in keys:
                ax.axhline(VETO_MAX, color="r", lw=1, ls="--", label=f"VETO_MAX = {VETO_MAX}")
            if P + "k3_kl" in keys or P + "chi2_token" in keys:
                vals = [y for _, _, ys in present for y in ys if math.isfinite(y)]
                if vals and min(vals) > 0 and max(vals) / min(vals) > 100:
                    ax.set_yscale("log")
            if len(present) > 1 or ax.get_legend_handles_labels()[0][1:]:
                ax.legend(fontsize=8)
            elif fname.startswith(("ess", "masked")) or P + "rollout_is_mean" in keys:
                ax.legend(fontsize=8)
        axes[-1, 0].set_xlabel("step")
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.suptitle(title)
        if fname in NOTES:
            fig.text(0.01, 0.005, NOTES[fname], fontsize=7, wrap=True, va="bottom")
            fig.tight_layout(rect=(0, 0.05, 1, 1))
        else:
            fig.tight_layout()
        figures.append((fname, fig))
    return figures


# ----------------------------------------------------------------------------- summary
#: What a summary row means where its key alone does not say it (dynamic sampling's two rewards).
SUMMARY_NOTES = {"reward/mean": " (the trained groups)", "reward/raw_mean": " (every generated sample)"}
SUMMARY_KEYS = ["reward/mean", "reward/raw_mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
                P + "kl", P + "k3_kl", P + "chi2_token", P + "chi2_seq", P + "rollout_is_mean",
                P + "rollout_is_p99", P + "rollout_is_eff_sample_size", P + "rollout_rs_masked_fraction",
                P + "rollout_is_veto_fraction", "perf/tokens_per_s", "val/reward_mean"]


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.4g}"


#: The keys of a record that holds a validation alone (with the ``val/*`` metrics).
VALIDATION_ONLY = ("step", "time", "timing/validation_s")


def summary_markdown(records: Sequence[dict], findings: Sequence[Finding], plots: Sequence[str],
                     run_dir: str) -> str:
    """The report.md text."""
    # a record of a validation alone (trainer.val_before_train: step 0) is no training step
    steps = [int(r["step"]) for r in records if any(k not in VALIDATION_ONLY and not k.startswith("val/") for k in r)]
    status = "UNHEALTHY" if any(f.severity == "FAIL" for f in findings) else (
        "STALLED" if any(f.check == "stalled" for f in findings) else (
            "CHECK WARNINGS" if any(f.severity == "WARN" for f in findings) else "HEALTHY"))
    span = f" ({steps[0]}..{steps[-1]})" if steps else ""
    lines = [f"# Run report: {run_dir}", "", f"**Status: {status}** - {len(steps)} steps{span}.", ""]
    t0, t1 = series(records, "time")[1][:1], series(records, "time")[1][-1:]
    if t0 and t1 and t1[0] > t0[0]:
        lines[-2] += f" Wall time {t1[0] - t0[0]:.1f} s."
    lines += ["## Findings", ""]
    if findings:
        lines += [f"- **{f.severity}** {f.check}: {f.message}" for f in findings]
    else:
        lines.append("- none: every check below passed (or its metric is absent).")
    w = min(LAST_WINDOW, len(records))
    lines += ["", f"## Metrics (mean of the first / last {w} steps, last-quarter mean)", "",
              f"| metric | first {w} | last {w} | last-quarter mean |", "|---|---|---|---|"]
    for k in SUMMARY_KEYS:
        _, ys = series(records, k)
        if ys:
            lines.append(f"| `{k}`{SUMMARY_NOTES.get(k, '')} | {_fmt(_mean(ys[:w]))} | {_fmt(_mean(ys[-w:]))} | "
                         f"{_fmt(_mean(_quarter(ys, True)))} |")
    lines += ["", "## Thresholds", "",
              f"- FAIL: any NaN/inf metric; failed-reward fraction > {REWARD_FAILED_FRAC_MAX} at a step; "
              f"ESS < {ESS_MIN}; veto fraction > {VETO_MAX}; "
              f"|mean IS weight - 1| > {IS_MEAN_DEV_MAX} (last-quarter means).",
              f"- WARN: any failed / timed-out reward; RS masked fraction > {RS_MASKED_MAX}; "
              f"IS ratio p99 > {IS_P99_MAX}; k3 KL last-quarter mean > "
              f"{K3_RISE_FACTOR} x first-quarter mean and > {K3_FLOOR}; smoothed reward range < {REWARD_FLAT_RANGE} "
              f"(trend checks need >= {MIN_STEPS} steps); dynamic sampling exhausted short of solved (INFO when "
              f"solved: within {1 - SOLVED_FRAC:.1f} of the reward's span of its ceiling).",
              f"- STALLED: over the last quarter the sampled reward's trend gained < {STALL_TREND} x its span over "
              f"the run, short of solved, with entropy < {ENTROPY_COLLAPSE} at every step of it or >= "
              f"{MIN_ZERO_GRAD_STEPS} zero-gradient steps.",
              ""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p}]({p})" for p in plots]
        lines.append("")
    return "\n".join(lines)


def write_report(run_dir: str, out_dir: Optional[str] = None) -> Tuple[str, List[Finding], List[str]]:
    """Read ``run_dir/metrics.jsonl``, write the PNGs and report.md to ``out_dir`` (default
    ``run_dir/report``). Returns (report.md path, findings, plot file names)."""
    records = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out_dir = out_dir or os.path.join(run_dir, "report")
    os.makedirs(out_dir, exist_ok=True)
    findings = health_checks(records)
    plots = make_plots(records, out_dir)
    md = os.path.join(out_dir, "report.md")
    with open(md, "w") as fh:
        fh.write(summary_markdown(records, findings, plots, run_dir))
    return md, findings, plots
