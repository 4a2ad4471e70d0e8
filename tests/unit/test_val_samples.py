"""trainer.val_log_samples (verl's trainer.log_val_generations): N validation responses per validation, chosen as
verl chooses them, in run_dir/val_generations.jsonl and as a W&B table; migrate maps verl's key to it.

The reference choice is verl's own code (RayPPOTrainer._maybe_log_val_generations, verl/trainer/ppo/ray_trainer.py,
verl 0.9.1), copied below; the W&B module is a stand-in capturing the calls (wandb is not installed here)."""
import json
import sys
import types

import numpy as np
import pytest

from megatron_rl.plan import collect_job_config
from megatron_rl.config.migrate_verl import migrate_verl
from megatron_rl.rollout.base import Rollout
from megatron_rl.rollout.versions import version_tag
from megatron_rl.tasks import build_char_tokenizer
from megatron_rl.tasks.val_set import build_val_set
from megatron_rl.trainer.run_dir import trim_to_step
from megatron_rl.trainer.sinks import MetricSinks
from megatron_rl.trainer.validation import Validation


def verl_pick(inputs, outputs, scores, generations_to_log):
    """verl's selection, verbatim but for the logger call."""
    samples = list(zip(inputs, outputs, scores, strict=True))
    samples.sort(key=lambda x: x[0])  # Sort by input text
    rng = np.random.RandomState(42)
    rng.shuffle(samples)
    return samples[:generations_to_log]


class _ReverseEngine:
    """Answers every prompt with its prompt tokens reversed (the char tokenizer decodes them back)."""

    def generate(self, prompt_ids, params, n=1, seed=None):
        return [Rollout(i // n, prompt_ids[i // n], list(reversed(prompt_ids[i // n]))[:3], [0.0] * 3, "stop",
                        version_tag(1)) for i in range(len(prompt_ids) * n)]


@pytest.fixture
def validation(tmp_path, monkeypatch):
    (tmp_path / "vr.py").write_text("def r(prompt_text, response_text, answer):\n"
                                    "    return float(len(prompt_text) % 3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"copy:{i * 7 % 10}{i}=", "answer": "x"}) + "\n" for i in range(9)))
    cfg, problems = collect_job_config(None, ["data.task=copy", f"data.val_files={path}", "data.reward_fn=vr:r",
                                              "data.reward_workers=0", "trainer.test_freq=1",
                                              "trainer.val_log_samples=4"], world_size=1)
    assert not [p for p in problems if p.startswith(("data.", "trainer."))], problems
    v = Validation(cfg, build_val_set(None, cfg.data, build_char_tokenizer()), _ReverseEngine())
    yield v
    v.close()


def test_the_logged_samples_are_verls_choice(validation):
    validation.run(1)
    got = validation.take_samples()
    assert validation.take_samples() == []                       # logged once
    tok = build_char_tokenizer()
    prompts = [p for g in validation.groups for p in g.prompts]
    outputs = [tok.decode(list(reversed(p.prompt_ids))[:3]) for p in prompts]
    scores = [float(len(p.text) % 3) for p in prompts]
    want = verl_pick([p.text for p in prompts], outputs, scores, 4)
    assert [(s.input, s.output, s.score) for s in got] == want
    assert {s.data_source for s in got} == {"v.jsonl"}               # the file name: rows without data_source


def test_sinks_write_jsonl_and_a_wandb_table(tmp_path, validation, monkeypatch):
    logged = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    run = types.SimpleNamespace(log=lambda d, step=None: logged.append((step, d)), finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **k: run, Table=Table))
    validation.run(1)
    samples = validation.take_samples()
    sinks = MetricSinks(str(tmp_path / "run"), 3, progress=False, wandb=True)
    sinks.log_val_samples(1, samples)
    sinks.log_val_samples(2, samples)
    sinks.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    assert [(r["input"], r["output"], r["score"], r["data_source"]) for r in rows[:4]] == \
        [(s.input, s.output, s.score, s.data_source) for s in samples]
    (step, d), = [x for x in logged if x[0] == 1]
    table = d["val/generations"]
    assert table.columns == ["step", "input", "output", "score", "data_source"] and len(table.data) == 4
    assert "dropped 4 record(s) of val_generations.jsonl after step 1" in trim_to_step(str(tmp_path / "run"), 1)


def test_a_run_that_starts_at_step_0_keeps_no_earlier_attempts_samples(tmp_path, validation):
    """--resume in a run_dir without a complete checkpoint (a Slurm requeue before the first checkpoint) begins a
    new run at step 0: like metrics.jsonl, val_generations.jsonl starts empty (the earlier attempt's step-0
    validation is not kept next to the new one); a run resumed from a checkpoint appends."""
    validation.run(1)
    samples = validation.take_samples()
    run = str(tmp_path / "run")
    first = MetricSinks(run, 3, progress=False)
    first.log_val_samples(0, samples)
    first.close()
    trim_to_step(run, 0)                       # what _resume does when there is no checkpoint
    again = MetricSinks(run, 3, progress=False, resume=False)
    again.log_val_samples(0, samples)
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * len(samples)
    resumed = MetricSinks(run, 3, progress=False, resume=True)
    resumed.log_val_samples(2, samples)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0] * len(samples) + [2] * len(samples)


def test_key_is_checked_and_migrated():
    _, problems = collect_job_config(None, ["trainer.val_log_samples=-1"], world_size=1)
    assert any(p.startswith("trainer.val_log_samples: must be >= 0") for p in problems), problems
    m = migrate_verl({"trainer": {"log_val_generations": 10}, "actor_rollout_ref": {}})
    assert m.tree["trainer"]["val_log_samples"] == 10
