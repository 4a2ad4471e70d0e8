"""Validation during training, the parts that need no ranks: the ``val/*`` metrics against hand-computed means,
the schedule (``trainer.test_freq`` / ``val_before_train``), the validation set's bound
(``data.val_max_samples``) and held-out prompts, the config keys' errors, and a validation file that does not load
failing ``megatron-rl check``, the launcher's start check and the trainer's first check with ``data.val_files``
named. The loop itself: tests/integration/test_validation_loop.py."""
import json
import os

import pytest

from megatron_rl.plan import collect_job_config
from megatron_rl.testing.jobs import job_problems
from megatron_rl.trainer.validation import Validation, val_metrics, val_sampling

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: the row of the table of jobs these tests check: configs/qwen2.5_7b_1x8.yaml
Q7 = "qwen2.5_7b_1x8"
MATH_DATA = os.path.join(ROOT, "examples", "math_tiny", "train.jsonl")


def test_val_metrics_are_the_means_per_data_source():
    # 3 prompts x n=2: prompt 0 (source a), prompts 1-2 (source b)
    m = val_metrics(["a", "a", "b", "b", "b", "b"], [1.0, 0.0, 0.5, 0.5, 1.0, 0.0], [3, 5, 2, 2, 4, 4],
                    [False, True, False, False, True, True], n=2)
    assert m == pytest.approx({
        "val/reward_mean": 3.0 / 6, "val/response_length_mean": 20 / 6, "val/prompts": 3,
        "val/a/reward_mean": 0.5, "val/a/response_length_mean": 4.0, "val/a/truncated_frac": 0.5, "val/a/prompts": 1,
        "val/b/reward_mean": 0.5, "val/b/response_length_mean": 3.0, "val/b/truncated_frac": 0.5, "val/b/prompts": 2,
    }, abs=1e-12)
    with pytest.raises(ValueError, match="equal and > 0"):
        val_metrics([], [], [], [], n=1)


def test_schedule_every_test_freq_steps_the_last_and_before_training():
    cfg, _ = job_problems(Q7, f"data.val_files={MATH_DATA}", "trainer.test_freq=2", "trainer.steps=5")
    v = Validation(cfg, None, None)
    assert [s for s in range(0, 6) if v.due(s)] == [2, 4, 5]
    assert v.due_before_train(0) and not v.due_before_train(3)   # --resume at step 3: not again
    cfg.trainer.val_before_train = False
    assert not v.due_before_train(0)
    cfg.trainer.test_freq = 0
    assert not any(v.due(s) for s in range(6))
    no_set, _ = job_problems(Q7, "trainer.test_freq=0")
    assert not Validation(no_set, None, None).enabled and not Validation(no_set, None, None).due_before_train(0)


def test_sampling_is_greedy_unless_do_sample():
    cfg, _ = job_problems(Q7, f"data.val_files={MATH_DATA}", "rollout.val_kwargs={temperature: 0.7, top_p: 0.5}")
    greedy = val_sampling(cfg, (7,))
    assert (greedy.temperature, greedy.top_p, greedy.stop_token_ids) == (0.0, 1.0, (7,))
    cfg.rollout.val_kwargs.do_sample = True
    sampled = val_sampling(cfg)
    assert (sampled.temperature, sampled.top_p, sampled.max_new_tokens) == (0.7, 0.5, cfg.rollout.max_new_tokens)


@pytest.mark.parametrize("overrides,message", [
    (["trainer.test_freq=-1"], "trainer.test_freq: must be >= 0 (0: never; verl's -1 is 0 here)"),
    (["trainer.test_freq=5"], "trainer.test_freq: 5 but there is no validation set"),
    (["data.val_files=nowhere.jsonl"],   # an override's relative path: from the current directory
     f"data.val_files: {os.path.abspath('nowhere.jsonl')!r} does not exist or is not a file"),
    ([f"data.val_files={MATH_DATA}", "data.val_max_samples=0"], "data.val_max_samples: must be -1 (all) or >= 1"),
    (["data.val_heldout=true"], "data.val_heldout: data.task 'file' has no held-out split"),
    (["rollout.val_kwargs.n=4"], "rollout.val_kwargs.n: 4 greedy responses per prompt are all the same"),
    (["rollout.val_kwargs.do_sample=true"], "rollout.val_kwargs.temperature: must be > 0 when do_sample is true"),
    (["trainer.val_timeout_s=-1"], "trainer.val_timeout_s: must be >= 0"),
    ([f"data.val_files={MATH_DATA}", "trainer.val_timeout_s=3600", "trainer.collective_timeout_s=1800"],
     "trainer.val_timeout_s: 3600.0 exceeds trainer.collective_timeout_s 1800.0"),
    ([f"data.val_files={MATH_DATA}", "rollout.mode=async", "trainer.test_freq=0"],   # val_before_train's default
     "trainer.val_before_train: validation during training runs with rollout.mode 'sync' only"),
    ([f"data.val_files={MATH_DATA}", "rollout.mode=async", "trainer.test_freq=2"], "trainer.test_freq: validation during training runs "
                                                              "with rollout.mode 'sync' only"),
])
def test_bad_validation_keys_are_named(overrides, message):
    _, problems = job_problems(Q7, *overrides)
    assert any(p.startswith(message) for p in problems), problems


def test_heldout_needs_a_split():
    _, problems = collect_job_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                                     ["data.val_heldout=true", "data.task_kwargs={min_digits: 1, max_digits: 2}"],
                                     world_size="cluster")
    assert any(p.startswith("data.val_heldout: needs data.task_kwargs.heldout_frac > 0") for p in problems), problems


def test_val_set_is_held_out_prompts_then_files_bounded_by_val_max_samples(tmp_path):
    from megatron_rl.tasks import DigitTask, build_char_tokenizer
    from megatron_rl.tasks.val_set import build_val_set
    import random

    tok = build_char_tokenizer()
    task = DigitTask("copy", tok, min_digits=1, max_digits=2, heldout_frac=0.2)
    held = [p.text for p in task.every_prompt() if task.is_heldout(p)]
    assert held and not {p.text for p in task.sample(500, random.Random(0))} & set(held)  # training never draws them
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy:{i}=", "answer": str(i), "data_source": "mine"}) + "\n"
                            for i in range(3)) + json.dumps({"prompt": "copy:7=", "answer": "7"}) + "\n")
    cfg, _ = collect_job_config(None, ["data.task=copy", "data.task_kwargs={min_digits: 1, max_digits: 2, "
                                       "heldout_frac: 0.2}", "data.val_heldout=true", f"data.val_files={path}",
                                       "data.reward_fn=exact", "data.reward_workers=0"], world_size=1)
    groups = build_val_set(task, cfg.data, tok)
    try:
        assert [p.text for p in groups[0].prompts] == held and set(groups[0].sources) == {"copy"}
        assert [p.text for p in groups[1].prompts] == ["copy:0=", "copy:1=", "copy:2=", "copy:7="]
        assert groups[1].sources == ["mine", "mine", "mine", "v.jsonl"]   # data_source, else the file's name
    finally:
        for g in groups:
            g.close()
    cfg.data.val_max_samples = len(held) + 2
    groups = build_val_set(task, cfg.data, tok)
    try:
        assert [len(g.prompts) for g in groups] == [len(held), 2]
    finally:
        for g in groups:
            g.close()


def test_a_validation_file_that_does_not_load_fails_check_start_and_training(tmp_path, capsys):
    from megatron_rl.cli import main as cli_main
    from megatron_rl.train import start_problems
    from megatron_rl.trainer.startup import check_data

    bad = tmp_path / "questions.jsonl"
    bad.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    # the math CPU config without its model built: no memory plan to size (seconds on a 7B config), the same check
    assert cli_main(["check", os.path.join(ROOT, "configs", "math_tiny_cpu.yaml"), f"data.val_files={bad}",
                     "trainer.test_freq=5"]) == 2
    err = capsys.readouterr().err
    assert f"data.val_files: data.val_files='{bad}': no usable rows (4 malformed" in err, err
    cfg, problems = job_problems(Q7, f"data.val_files={bad}", "trainer.test_freq=5")
    assert problems == []  # the file exists: only reading it tells
    assert [p for p in start_problems(cfg) if p.startswith("data.val_files:")], start_problems(cfg)
    with pytest.raises(ValueError, match=r"data.val_files: data.val_files='.*questions.jsonl': no usable rows"):
        check_data(cfg)


def test_metrics_file_and_console_carry_validation(tmp_path, capsys):
    from megatron_rl.trainer.sinks import MetricSinks

    sinks = MetricSinks(str(tmp_path), total_steps=2, table_interval=2)
    val = {"val/reward_mean": 0.25, "val/a/reward_mean": 0.5, "val/b/reward_mean": 0.0, "val/prompts": 4.0,
           "val/response_length_mean": 3.0}
    sinks.log_validation(0, val)
    sinks.log(1, {"reward/mean": 0.1})
    sinks.log(2, {"reward/mean": 0.3, **{k: v + 0.5 for k, v in val.items() if k.endswith("reward_mean")}})
    sinks.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {k: records[0][k] for k in val} == val and "val/reward_mean" not in records[1]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[megatron-rl] validation before training: reward 0.25 | a 0.5; b 0 | 4 prompt(s), len 3"
    assert out[3].startswith("[megatron-rl] validation after step 2: reward 0.75 | a 1; b 0.5")
    assert out[4].startswith("[megatron-rl] steps 1-2 (2 step(s)): reward mean 0.2") and \
        out[4].endswith("val reward 0.75 (step 2)")


def _hung_validation(err_path):
    """Child: a validation that never returns, under the loop's watchdog phase with trainer.val_timeout_s 0.3."""
    import sys
    import time
    from types import SimpleNamespace

    from megatron_rl.trainer.loop import _validate
    from megatron_rl.trainer.watchdog import Watchdog

    sys.stderr = open(err_path, "w")  # abort's message (pytest captures the parent's)
    job = SimpleNamespace(watchdog=Watchdog(0, 1800.0, poll_s=0.05),
                          cfg=SimpleNamespace(trainer=SimpleNamespace(val_timeout_s=0.3)),
                          validation=SimpleNamespace(run=lambda done: time.sleep(60)))
    _validate(job, 4)


def test_a_validation_past_val_timeout_s_ends_the_rank_naming_the_key(tmp_path):
    import multiprocessing

    from megatron_rl.trainer.watchdog import EXIT_HUNG

    err = tmp_path / "stderr"
    child = multiprocessing.get_context("fork").Process(target=_hung_validation, args=(str(err),))
    child.start()
    child.join(30)
    assert child.exitcode == EXIT_HUNG, child.exitcode
    assert "validation of step 4 did not finish within 0.3 s (trainer.val_timeout_s)" in err.read_text()


def test_a_validation_file_whose_data_source_has_no_reward_fails_check_and_start(tmp_path, capsys):
    # data.reward_fn unset: the reward is chosen by data_source; one with no built-in reward made the trainer fail
    # on rank 0 after the model was built, while check and the start check passed
    from megatron_rl.cli import main as cli_main
    from megatron_rl.trainer.startup import check_data

    bad = tmp_path / "v.jsonl"
    bad.write_text(json.dumps({"data_source": "my org/unknown", "prompt": "1+1?", "answer": "2"}) + "\n")
    assert cli_main(["check", os.path.join(ROOT, "configs", "math_tiny_cpu.yaml"), f"data.val_files={bad}",
                     "data.reward_fn=null"]) == 2
    assert "data.val_files: data.val_files=" in capsys.readouterr().err
    cfg, problems = job_problems(Q7, f"data.val_files={bad}", "data.reward_fn=null")
    assert problems == []
    with pytest.raises(ValueError, match=r"data.val_files: .*data_source='my org/unknown' has no built-in reward"):
        check_data(cfg)
    cfg.data.reward_fn = "exact"  # a reward for every row: the file loads
    check_data(cfg)


def test_val_timeout_s_above_the_collective_timeout_is_allowed_on_one_rank_only():
    from megatron_rl.plan import job_errors

    cfg, _ = job_problems(Q7, f"data.val_files={MATH_DATA}", "trainer.val_timeout_s=3600",
                          "trainer.collective_timeout_s=1800")
    assert not [e for e in job_errors(cfg, 1) if e.startswith("trainer.val_timeout_s")]   # no collective to wait in
    cfg.trainer.val_timeout_s = 1800.0
    assert not [e for e in job_errors(cfg, 8) if e.startswith("trainer.val_timeout_s")]


class _EchoEngine:
    """Answers every prompt with its own last token, as the weight version the validation expects."""

    def __init__(self, version):
        self.version = version

    def generate(self, prompt_ids, params, n=1, seed=None):
        from megatron_rl.rollout.base import Rollout

        return [Rollout(i // n, prompt_ids[i // n], [prompt_ids[i // n][-1]], [0.0], "stop", self.version)
                for i in range(len(prompt_ids) * n)]


def test_failed_validation_rewards_are_counted_and_over_the_limit_raise(tmp_path, monkeypatch, capsys):
    # a reward that raises scored 0 silently: val/reward_mean fell with nothing to tell why
    from megatron_rl.rollout.versions import version_tag
    from megatron_rl.tasks import build_char_tokenizer
    from megatron_rl.tasks.val_set import build_val_set
    from megatron_rl.trainer.reward_failures import RewardFailureError

    (tmp_path / "vreward.py").write_text("def r(prompt_text, response_text, answer):\n"
                                         "    if answer == 'bad':\n        raise ValueError('broken verifier')\n"
                                         "    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy:{i}=", "answer": a}) + "\n"
                            for i, a in enumerate(["1", "bad", "1", "1"])))
    cfg, problems = collect_job_config(None, ["data.task=copy", f"data.val_files={path}", "data.reward_fn=vreward:r",
                                              "data.reward_workers=0", "trainer.test_freq=1"], world_size=1)
    assert not [p for p in problems if p.startswith(("data.", "trainer."))], problems
    groups = build_val_set(None, cfg.data, build_char_tokenizer())
    v = Validation(cfg, groups, _EchoEngine(version_tag(2)))
    try:
        m = v.run(2)
        assert (m["val/reward_failed"], m["val/reward_timed_out"], m["val/reward_mean"]) == (1.0, 0.0, 0.75)
        assert "validation after step 2: 1 reward(s) failed and 0 timed out (scored 0)" in capsys.readouterr().err
        cfg.data.max_reward_failure_frac = 0.2
        with pytest.raises(RewardFailureError, match=r"validation after step 2: 1 reward\(s\) failed .*\(25% > "
                                                     r"data.max_reward_failure_frac=0.2"):
            v.run(2)
    finally:
        v.close()


def test_a_stop_requested_skips_the_due_validation_for_the_checkpoint(monkeypatch, capsys):
    # a validation (up to trainer.val_timeout_s) ran between a SIGTERM and the checkpoint, which must come within
    # trainer.stop_timeout_s: a preempted run lost its last step
    import contextlib
    from types import SimpleNamespace

    from megatron_rl.trainer import loop

    calls = []
    cfg, _ = job_problems(Q7, f"data.val_files={MATH_DATA}", "trainer.test_freq=1", "trainer.steps=3")
    job = SimpleNamespace(
        cfg=cfg, start_step=0, rank0=True, validation=Validation(cfg, None, None),
        stop=SimpleNamespace(requested=False), watchdog=SimpleNamespace(phase=lambda *a, **k: contextlib.nullcontext()),
        sinks=SimpleNamespace(log=lambda step, m: calls.append(("log", step, sorted(m))),
                              log_validation=lambda step, m: calls.append(("log_validation", step))),
        dump=lambda step, batch: None, checkpoint_due=lambda step, stopping: stopping or step == 3,
        checkpoint=lambda step, stopping: calls.append(("checkpoint", step, stopping)), close=lambda step: None)
    job.validation.run = lambda done: calls.append(("validate", done)) or {"val/reward_mean": 1.0}

    def step_fn(j, step):
        j.stop.requested = step == 1   # the signal arrives during the second step
        return {"reward/mean": 0.0}, None

    monkeypatch.setattr(loop, "build_job", lambda cfg, stop=None: job)
    monkeypatch.setattr(loop, "train_step", step_fn)
    monkeypatch.setattr(loop, "any_rank", lambda flag: flag)   # one rank
    loop.train(cfg)
    assert calls == [("validate", 0), ("log_validation", 0), ("validate", 1), ("log", 1, ["reward/mean",
                     "val/reward_mean"]), ("log", 2, ["reward/mean"]), ("checkpoint", 2, True)]
    assert "validation after step 2 skipped: stopping" in capsys.readouterr().out


def test_report_does_not_count_the_validation_before_training_as_a_step():
    from megatron_rl.ops.report import summary_markdown

    records = [{"step": 0, "time": 0.0, "val/reward_mean": 0.1, "timing/validation_s": 1.0}] + \
        [{"step": s, "time": float(s), "reward/mean": 0.5, "val/reward_mean": 0.2} for s in (1, 2, 3)]
    text = summary_markdown(records, [], [], "run")
    assert "**Status: HEALTHY** - 3 steps (1..3)." in text, text.splitlines()[2]
    assert "| `val/reward_mean` |" in text   # the validation's value is still in the table
