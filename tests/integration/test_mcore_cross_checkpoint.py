"""Checkpoints cross megatron-core releases: written under 0.16.1 load under 0.19.x, and the reverse.

Each side runs in its own venv's python (``tests/integration/mcore_ckpt_worker.py``, a subprocess): the writer trains one
step from seed 7 and saves (model + both Adam optimizers, MoE at TP2 + SP x EP2, ETP1), the loader starts from
seed 99 and loads. Checked: the loaded weights equal the saved ones bit for bit, the log-probs of a fixed batch
are equal, and one more train step (which reads Adam's state) gives the same weights on both sides.

The venvs: ``$MEGATRON_RL_VENV`` (default .venv, megatron-core 0.16.x) and ``$MEGATRON_RL_VENV_NEWEST`` (default
.venv-mcore019, 0.19.x), both made by ``tools/run_tests.sh`` before its first leg; without both the test skips
(``bash tools/setup_env.sh --dev --mcore 0.19.2`` makes the second).

Run: ``OMP_NUM_THREADS=1 pytest tests/integration/test_mcore_cross_checkpoint.py -q``   (~2-4 min on 2 cores)
"""
import os
import subprocess

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


def _run(py, mode, ckpt, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_VCS_VERSION="1")
    env.pop("PYTHONPATH", None)
    r = subprocess.run([py, os.path.join(ROOT, "tests", "integration", "mcore_ckpt_worker.py"), mode, str(ckpt), str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, f"{py} {mode}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("writer,reader", [("0.16", "0.19"), ("0.19", "0.16")], ids=["016-to-019", "019-to-016"])
def test_checkpoint_written_by_one_release_loads_in_the_other(tmp_path, writer, reader):
    wpy, rpy = _python(writer), _python(reader)
    saved = _run(wpy, "save", tmp_path / "ckpt", tmp_path / "saved.pt")
    loaded = _run(rpy, "load", tmp_path / "ckpt", tmp_path / "loaded.pt")
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
