"""The LoRA rows' run check (tests/integration/test_readme_rows.py): train == rollout at every step while the adapters
move. Bounds: the bf16-engine-vs-fp32-trainer mismatch of the shipped CPU jobs (measured on these rows: k3 KL
<= 1e-5, mean |log-ratio| <= 1e-3 per token); an unmerged adapter at the rows' lr exceeds them by step 2 (a sync of
the base alone: docs/lora.md#the-configs-in-the-readme)."""
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
