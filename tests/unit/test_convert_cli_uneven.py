"""``megatron-rl convert hf-to-mcore --num-layers-in-first/last-pipeline-stage``: uneven pipeline stages from the
command line, with the tiny DeepSeek-V3 (3 layers).

References: the layer count of each written stage file is the split asked for (not derived from the code under
test), and ``mcore-to-hf`` of the result equals the source HF tensors bit for bit; a split that does not add up
is refused with ``error:`` naming the option and exit status 2 before anything is written.

Run: ``OMP_NUM_THREADS=1 pytest tests/unit/test_convert_cli_uneven.py -q``
"""
import re

import pytest
import torch

from megatron_rl.cli import main as cli_main
from megatron_rl.convert import storage

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_model):
    return tiny_hf_model("deepseek_v3", seed=3)


def _stage_layers(path):
    names = storage.read_safetensors([path])
    return {int(m.group(1)) for k in names if (m := re.match(r"decoder\.layers\.(\d+)\.", k))}


@pytest.mark.parametrize("flag,value,split", [("--num-layers-in-first-pipeline-stage", "2", (2, 1)),
                                              ("--num-layers-in-last-pipeline-stage", "2", (1, 2))])
def test_uneven_stages_round_trip(hf_dir, tmp_path, capsys, flag, value, split):
    mc = str(tmp_path / "mc")
    rc = cli_main(["convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", mc, "--pipeline-model-parallel-size", "2",
                   "--expert-model-parallel-size", "2", flag, value])
    assert rc == 0, capsys.readouterr().err
    assert "DeepseekV3ForCausalLM" in capsys.readouterr().out
    # stage-local layer numbers: stage p holds split[p] layers
    for pp, n in enumerate(split):
        assert _stage_layers(storage.dense_file(mc, 0, pp)) == set(range(n)), f"stage {pp}"
    hf_out = str(tmp_path / "hf")
    assert cli_main(["convert", "mcore-to-hf", "--mcore-dir", mc, "--out", hf_out]) == 0
    src, out = storage.read_hf_state_dict(hf_dir), storage.read_hf_state_dict(hf_out)
    assert sorted(src) == sorted(out)
    for k, v in src.items():
        assert torch.equal(v, out[k]), k


def test_bad_split_is_refused(hf_dir, tmp_path, capsys):
    mc = tmp_path / "mc"
    rc = cli_main(["convert", "hf-to-mcore", "--hf-dir", hf_dir, "--out", str(mc), "--pipeline-model-parallel-size",
                   "2", "--num-layers-in-first-pipeline-stage", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "num_layers_in_first_pipeline_stage" in err, err
    assert not (mc / storage.METADATA_FILE).exists()
