"""The LoRA rows' run check (tests/integration/test_readme_rows.py): train == rollout at every step while the adapters
move. Bounds: the bf16-engine-vs-fp32-trainer mismatch of a 2-step run (measured, steps 1-3: k3 KL <= 2e-6 and
mean |log-ratio| <= 8e-4 per token on the MoE row; a whole 240-step dense LoRA run stays <= 8e-4 / 0.0103, the
full-parameter MoE recipe's 200 steps <= 3.6e-3 / 0.0107); a merged sync that drops B·A (the base alone) gives
0.015 / 0.071 at step 2 on the MoE row, 0.057 / 0.11 on the dense one (docs/lora.md#the-configs-in-the-readme)."""
import json
import os

from safetensors.torch import load_file

from megatron_rl.actor.hf_io import export_checkpoint_to_hf
from megatron_rl.trainer.job import latest_checkpoint

#: rollout_corr/k3_kl (per token, engine vs trainer) must stay below this at every step.
MAX_K3_KL = 1e-3
#: rollout_corr/log_ppl_abs_diff must stay below this at every step.
MAX_LOG_PPL_ABS_DIFF = 1e-2


def check_lora_run(run_dir, out_dir) -> None:
    """Assert the mismatch bounds at every step of ``run_dir``'s metrics and that the adapters of its last
    checkpoint moved (lora_B starts at zero)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    for r in recs:
        k3, ad = r["rollout_corr/k3_kl"], r["rollout_corr/log_ppl_abs_diff"]
        assert k3 <= MAX_K3_KL and ad <= MAX_LOG_PPL_ABS_DIFF, (r["step"], k3, ad)
    export_checkpoint_to_hf(latest_checkpoint(str(run_dir)), str(out_dir))
    tensors = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
    bs = [t for k, t in tensors.items() if "lora_B" in k]
    assert bs and all(float(t.abs().max()) > 0 for t in bs), "an adapter's lora_B is still zero: nothing moved"
