"""tools/pkg_install.sh hands uv exactly pip's effective settings.

The set-ups install with ``uv pip install``, which does not read pip's config files or PIP_* variables; the script
translates them. The reference is pip's own option parser (``pip install``'s defaults under the same files and
variables): the indexes, find-links locations, constraints and no-index uv gets must be the ones pip would use,
with pip's precedence (PIP_* variables over the [install] section over [global]).
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYPI = "https://pypi.org/simple"  # the default index of both pip and uv

PIP_OPTIONS = """
import json
from pip._internal.commands import create_command
opts, _ = create_command("install").parse_args([])
print(json.dumps({"index": opts.index_url, "extra": opts.extra_index_urls, "find_links": opts.find_links,
                  "constraints": opts.constraints, "no_index": bool(opts.no_index)}))
"""

UV_ARGS = 'source tools/pkg_install.sh; eval "$(pip_settings_for_uv "$PY")"; printf "%s\\0" "${UV_ARGS[@]}"'


def _settings(env):
    pip = json.loads(subprocess.run([sys.executable, "-c", PIP_OPTIONS], env=env, capture_output=True, text=True,
                                    check=True, timeout=60).stdout)
    args = subprocess.run(["bash", "-c", UV_ARGS], cwd=ROOT, env={**env, "PY": sys.executable}, capture_output=True,
                          text=True, check=True, timeout=60).stdout.split("\0")[:-1]
    pairs = list(zip(args[::2], args[1::2]))
    uv = {"index": [v for k, v in pairs if k == "--index-url"] or [PYPI],
          "extra": [v for k, v in pairs if k == "--extra-index-url"],
          "find_links": [v for k, v in pairs if k == "--find-links"],
          "constraints": [v for k, v in pairs if k == "-c"],
          "no_index": "--no-index" in args}
    assert ("--index-strategy", "unsafe-best-match") in pairs  # pip's: the best version over all indexes
    assert len(uv["index"]) == 1, args
    uv["index"] = uv["index"][0]
    return pip, uv


def test_pip_files_and_variables_reach_uv_with_pips_precedence(tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://files.example/simple\n"
                    "extra-index-url = file:///srv/a/simple file:///srv/b/simple\nfind-links = /srv/global-wheels\n"
                    "[install]\nfind-links = /srv/install-wheels /srv/more-wheels\n")
    (tmp_path / "c.txt").write_text("torch<=2.13.0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=str(conf), PIP_INDEX_URL="https://env.example/simple",
               PIP_CONSTRAINT=str(tmp_path / "c.txt"))
    pip, uv = _settings(env)
    assert pip["index"] == "https://env.example/simple"  # the variable over the file
    assert pip["find_links"] == ["/srv/install-wheels", "/srv/more-wheels"]  # [install] over [global]
    assert uv == pip


def test_variables_alone_and_no_index(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="/srv/w1 /srv/w2", PIP_NO_INDEX="1",
               PIP_EXTRA_INDEX_URL="file:///srv/x/simple")
    pip, uv = _settings(env)
    assert pip["no_index"] and pip["find_links"] == ["/srv/w1", "/srv/w2"]
    assert uv == pip
