"""What a person reads on the console: warnings once per job (deprecation notices on rank 0 only, each
distinct message once), one line per step (a periodic summary adds window statistics instead of repeating
the per-step lines), and the layout printed once at start.

    pytest tests/test_console_output.py
"""
import os
import subprocess
import sys

WARN_CODE = r'''
import warnings
from megatron_rl.platform.warnings import install_known_message_filter
install_known_message_filter()
def load_state_dict_like():   # two call sites, as megatron's and torch's checkpoint loaders have
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
def other_site():
    warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning)
for _ in range(3):
    load_state_dict_like(); other_site()
    warnings.warn("some library: this API is going away", FutureWarning)
    warnings.warn("a rank-specific problem", UserWarning)
'''


def _stderr(rank):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID", "MEGATRON_RL_SHOW_KNOWN_WARNINGS")}
    env.update(RANK=str(rank), PYTHONWARNINGS="always")
    return subprocess.run([sys.executable, "-c", WARN_CODE], capture_output=True, text=True, env=env,
                          timeout=60).stderr


def test_deprecation_warnings_once_on_rank0_none_elsewhere():
    err0 = _stderr(0).splitlines()
    assert sum("ShardedTensor" in ln for ln in err0) == 1, err0          # two call sites x 3: one line
    assert sum("this API is going away" in ln for ln in err0) == 1, err0  # unknown FutureWarning: once
    assert sum("a rank-specific problem" in ln for ln in err0) == 1, err0
    assert not any(ln.strip().startswith("warnings.warn(") for ln in err0), err0  # no source-line echo
    err1 = _stderr(1)
    assert "ShardedTensor" not in err1 and "going away" not in err1, err1  # deprecations: rank 0 only
    assert err1.count("a rank-specific problem") == 1, err1                # other warnings: where raised
