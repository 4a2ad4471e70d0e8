"""A resumed run continues its W&B run: the id is kept in run_dir/wandb_id and passed back with resume="allow".

wandb is not installed in the test environment, so ``wandb.init``'s arguments are captured by a stand-in module
(the sinks import ``wandb`` by name); what is checked is the id bookkeeping and the arguments W&B documents for
resuming (``id=``, ``resume="allow"``).
"""
import sys
import types

import pytest

from megatron_rl.trainer.run_dir import run_dir_error, start_over
from megatron_rl.trainer.sinks import MetricSinks


class _Run:
    def __init__(self):
        self.logged = []

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        pass


@pytest.fixture
def wandb_calls(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return _Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    return calls


def _sinks(run_dir, resume):
    s = MetricSinks(str(run_dir), 4, progress=False, wandb=True, wandb_project="p", resume=resume)
    s.log(1, {"reward/mean": 0.5})
    s.close()


def test_resumed_run_continues_the_same_wandb_run(tmp_path, wandb_calls, capsys):
    _sinks(tmp_path, resume=False)
    first = wandb_calls[0]
    assert set(first) >= {"id", "project", "dir"} and "resume" not in first
    assert (tmp_path / "wandb_id").read_text().strip() == first["id"]
    assert len(first["id"]) == 8 and first["id"].isalnum() and first["id"].islower()
    _sinks(tmp_path, resume=True)
    again = wandb_calls[1]
    assert (again["id"], again["resume"]) == (first["id"], "allow")
    assert f"continuing run {first['id']}" in capsys.readouterr().out


def test_fresh_runs_get_new_ids_and_overwrite_forgets_the_old_one(tmp_path, wandb_calls):
    _sinks(tmp_path, resume=False)
    assert "wandb_id" in (run_dir_error(str(tmp_path), False, False) or "")   # an output of the run
    start_over(str(tmp_path))
    assert not (tmp_path / "wandb_id").exists()
    _sinks(tmp_path, resume=False)
    assert wandb_calls[0]["id"] != wandb_calls[1]["id"]


def test_resume_without_an_id_file_starts_a_new_wandb_run(tmp_path, wandb_calls, capsys):
    _sinks(tmp_path, resume=True)
    assert "resume" not in wandb_calls[0]
    assert (tmp_path / "wandb_id").read_text().strip() == wandb_calls[0]["id"]
    assert "had no W&B id" in capsys.readouterr().out
