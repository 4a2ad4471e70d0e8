"""Known megatron-core notices (TE / Apex missing, deprecated scope, CUDA_DEVICE_MAX_CONNECTIONS, the rerun
state machine): one line each on rank 0 saying why they are harmless, nothing on other ranks; other
warnings unchanged.

    pytest tests/integration/test_platform_warnings.py
"""
import os
import subprocess
import sys

CODE = r'''
import logging, warnings
from megatron_rl.platform.warnings import install_known_message_filter
install_known_message_filter()
for _ in range(3):
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
    warnings.warn("When using async grad allreduce it is recommended to set the environment variable "
                  "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", UserWarning)
warnings.warn("something new and important", UserWarning)
logging.getLogger("megatron.core.rerun_state_machine").warning("Implicit initialization of Rerun State Machine!")
logging.getLogger("megatron.core.rerun_state_machine").warning("a real rerun problem")
'''


def _run(rank, **extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "MEGATRON_RL_SHOW_KNOWN_WARNINGS")}
    env.update(RANK=str(rank), PYTHONWARNINGS="always", **extra)
    return subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=60).stderr


def test_rank0_says_once_that_known_messages_are_hidden():
    err = _run(0).splitlines()
    known = [ln for ln in err if "known, harmless" in ln]
    assert len(known) == 1 and "are hidden" in known[0] and "MEGATRON_RL_SHOW_KNOWN_WARNINGS=why" in known[0], err
    text = "\n".join(err)
    assert "Transformer Engine and Apex" not in text and "CUDA_DEVICE_MAX" not in text and "Rerun State" not in text
    assert "UserWarning: something new and important" in text and "a real rerun problem" in text


def test_rank0_shows_each_known_message_once_with_why_when_asked():
    err = _run(0, MEGATRON_RL_SHOW_KNOWN_WARNINGS="why").splitlines()
    known = [ln for ln in err if ln.startswith("[megatron-rl] known, harmless:")]
    assert len(known) == 3, err
    assert any("Transformer Engine and Apex are not installed" in ln and "torch implementations" in ln for ln in known)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS" in ln and "--" in ln for ln in known)
    assert any("Implicit initialization of Rerun State Machine!" in ln for ln in known)
    text = "\n".join(err)
    assert "UserWarning: something new and important" in text and "a real rerun problem" in text


def test_other_ranks_show_only_unknown_messages():
    err = _run(1)
    assert "known, harmless" not in err and "Transformer Engine" not in err and "Rerun State Machine" not in err
    assert "something new and important" in err and "a real rerun problem" in err
