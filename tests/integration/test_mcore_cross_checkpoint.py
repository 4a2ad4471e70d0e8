"""Checkpoints cross megatron-core releases: written under 0.16.1 load under 0.19.x, and the reverse.

Each side runs in its own venv's python (``tests/integration/mcore_ckpt_worker.py``, a subprocess): the writer trains one
step from seed 7 and saves (model + both Adam optimizers, MoE at TP2 + SP x EP2, ETP1), the loader starts from
seed 99 and loads. Checked: the loaded weights equal the saved ones bit for bit, the log-probs of a fixed batch
are equal, and one more train step (which reads Adam's state) gives the same weights on both sides.

Three worker calls serve both directions (the module's ``crossed`` fixture): 0.16 saves A; 0.19 loads A, then
saves B (fresh ranks and model for each); 0.16 loads B. A side whose venv is the one running pytest forks its ranks
from this process (the worker's ``_rank``, megatron already imported) instead of starting that venv's python.

The venvs: ``$MEGATRON_RL_VENV`` (default .venv, megatron-core 0.16.x) and ``$MEGATRON_RL_VENV_NEWEST`` (default
.venv-mcore019, 0.19.x), both made by ``tools/run_tests.sh`` before its first leg; without both the test skips
(``bash tools/setup_env.sh --dev --mcore 0.19.2`` makes the second).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_mcore_cross_checkpoint.py -q``   (~2-4 min on 2 cores)
"""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENVS = {"0.16": os.environ.get("MEGATRON_RL_VENV", ".venv"),
         "0.19": os.environ.get("MEGATRON_RL_VENV_NEWEST", ".venv-mcore019")}


def _python(minor):
    venv = VENVS[minor]
    py = os.path.join(venv if os.path.isabs(venv) else os.path.join(ROOT, venv), "bin", "python")
    if not os.path.isfile(py):
        pytest.skip(f"no megatron-core {minor} venv at {venv} (bash tools/setup_env.sh --dev --mcore ...)")
    return py


def _run(py, *calls):
    """The worker's ``(mode, ckpt, out)`` calls in order, by ``py``; their outputs (rank 0's results)."""
    if os.path.realpath(sys.prefix) == os.path.realpath(os.path.dirname(os.path.dirname(py))):
        from mcore_ckpt_worker import _rank  # this venv's side: ranks forked from this process

        from megatron_rl.testing.distributed import run_ranks

        return [run_ranks(_rank, 2, mode, str(ckpt), timeout=240)[0] for mode, ckpt, _ in calls]
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_VCS_VERSION="1")
    env.pop("PYTHONPATH", None)
    args = [str(a) for call in calls for a in call]
    r = subprocess.run([py, os.path.join(ROOT, "tests", "integration", "mcore_ckpt_worker.py"), *args],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=500 * len(calls))
    assert r.returncode == 0, f"{py} {args}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return [torch.load(out, weights_only=False) for _, _, out in calls]


@pytest.fixture(scope="module")
def crossed(tmp_path_factory):
    """{(writer, reader): (saved, loaded)} for both directions, from three worker interpreters."""
    old, new = _python("0.16"), _python("0.19")
    d = tmp_path_factory.mktemp("cross")
    a, b = d / "ckpt_016", d / "ckpt_019"
    [saved_a] = _run(old, ("save", a, d / "saved_016.pt"))
    loaded_a, saved_b = _run(new, ("load", a, d / "loaded_019.pt"), ("save", b, d / "saved_019.pt"))
    [loaded_b] = _run(old, ("load", b, d / "loaded_016.pt"))
    return {("0.16", "0.19"): (saved_a, loaded_a), ("0.19", "0.16"): (saved_b, loaded_b)}


@pytest.mark.parametrize("writer,reader", [("0.16", "0.19"), ("0.19", "0.16")], ids=["016-to-019", "019-to-016"])
def test_checkpoint_written_by_one_release_loads_in_the_other(crossed, writer, reader):
    saved, loaded = crossed[(writer, reader)]
    assert saved["mcore"].startswith(writer + ".") and loaded["mcore"].startswith(reader + "."), \
        (saved["mcore"], loaded["mcore"])
    assert loaded["extra"] == {"written_by": saved["mcore"]}
    assert sorted(saved["weights"]) == sorted(loaded["weights"])
    assert any(".mlp.experts." in k for k in saved["weights"])
    for k, w in saved["weights"].items():
        assert torch.equal(loaded["weights"][k], w), f"weight {k} differs after loading"
    torch.testing.assert_close(loaded["logprobs"], saved["logprobs"], rtol=0, atol=1e-6)
    for k, w in saved["weights_after_step"].items():
        torch.testing.assert_close(loaded["weights_after_step"][k], w, rtol=0, atol=1e-6,
                                   msg=lambda s: f"weight {k} after the next step (Adam state): {s}")
