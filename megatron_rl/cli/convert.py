"""``megatron-rl convert``: HF safetensors <-> Megatron per-rank shards, in one process (no GPUs, no
process group — pure tensor slicing).

    megatron-rl convert hf-to-mcore --hf-dir D --out O --tensor-model-parallel-size T \\
        --pipeline-model-parallel-size P [--expert-model-parallel-size E] [--expert-tensor-parallel-size ET] \\
        [--num-layers-in-first-pipeline-stage F] [--num-layers-in-last-pipeline-stage L] \\
        [--make-vocab-size-divisible-by 1] [--overwrite]
    megatron-rl convert mcore-to-hf --mcore-dir O --out D2 [--hf-assets-dir HF] [--merge] [--overwrite]

``--mcore-dir`` may also be a training checkpoint of the RL loop (``trainer.run_dir/checkpoints/step_N``,
any TP/PP/EP layout; config and tokenizer files from ``--hf-assets-dir`` or the run's ``actor.load_hf``) or
a megatron torch_dist (dist_checkpointing) checkpoint of the model. A LoRA run (``actor.lora``) is written as a
PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``), with ``--merge`` as the merged HF model.

Bad input (unsupported ``architectures``, a layout that does not divide heads / KV heads / FFN / experts /
layers, missing or unexpected tensors, shape mismatches, a non-empty output directory) prints one
``error:`` line naming what is wrong and exits with status 2 before anything is written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_rl.actor.hf_io import export_checkpoint_to_hf, is_actor_checkpoint
from megatron_rl.convert import (CheckpointFormatError, CheckpointMismatchError, LayoutError, ShardLayout,
                                 UnsupportedCheckpointError, convert_hf_to_mcore, convert_mcore_to_hf)


def _hf_to_mcore(args: argparse.Namespace) -> int:
    layout = ShardLayout(tensor_model_parallel_size=args.tensor_model_parallel_size,
                         pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                         expert_model_parallel_size=args.expert_model_parallel_size,
                         expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         num_layers_in_first_pipeline_stage=args.num_layers_in_first_pipeline_stage,
                         num_layers_in_last_pipeline_stage=args.num_layers_in_last_pipeline_stage)
    t0 = time.time()
    meta = convert_hf_to_mcore(args.hf_dir, args.out, layout, overwrite=args.overwrite)
    g = meta["geometry"]
    print(f"converted {g['architecture']} ({g['num_layers']} layers) from {args.hf_dir} to {args.out}: "
          f"TP={layout.tp} PP={layout.pp} EP={layout.ep} ETP={layout.etp}, padded vocab "
          f"{meta['padded_vocab_size']} (HF {g['vocab_size']}), dtypes {meta['dtypes']}, {time.time() - t0:.1f}s")
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> int:
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:
        raise CheckpointFormatError(f"output directory {args.out} is not empty; pass --overwrite to write into it")
    t0 = time.time()
    if is_actor_checkpoint(args.mcore_dir):
        files = export_checkpoint_to_hf(args.mcore_dir, args.out, assets_dir=args.hf_assets_dir, merge=args.merge)
    else:
        files = convert_mcore_to_hf(args.mcore_dir, args.out, assets_dir=args.hf_assets_dir, merge=args.merge)
    print(f"exported {args.mcore_dir} to HF safetensors in {args.out} ({len(files)} file(s), "
          f"{time.time() - t0:.1f}s)")
    return 0


def _run(fn):
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (CheckpointFormatError, CheckpointMismatchError, LayoutError, UnsupportedCheckpointError,
                FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return wrapped


def add_parser(subparsers) -> None:
    """Register ``convert`` and its two directions on the top-level subparsers."""
    p = subparsers.add_parser("convert", help="convert checkpoints between HF and Megatron layouts",
                              description="Convert checkpoints between HF safetensors and Megatron per-rank "
                                          "shards (one process, pure tensor slicing; no GPU, no process group).")
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True

    a = sub.add_parser("hf-to-mcore", help="HF safetensors -> Megatron per-rank shards")
    a.add_argument("--hf-dir", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--out", required=True, help="output directory for the converted checkpoint")
    a.add_argument("--tensor-model-parallel-size", type=int, default=1)
    a.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    a.add_argument("--expert-model-parallel-size", type=int, default=1)
    a.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="tensor parallel size inside experts (default: = TP, megatron's default)")
    a.add_argument("--num-layers-in-first-pipeline-stage", type=int, default=None,
                   help="uneven pipeline: layers of the first stage (default: even split; megatron's option)")
    a.add_argument("--num-layers-in-last-pipeline-stage", type=int, default=None,
                   help="uneven pipeline: layers of the last stage (default: even split; megatron's option)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=1,
                   help="pad the vocab to a multiple of this x TP (default 1: pad only to a multiple of TP; "
                        "padded logit columns must be masked by the log-prob code)")
    a.add_argument("--overwrite", action="store_true", help="replace a converted checkpoint already in --out")
    a.set_defaults(func=_run(_hf_to_mcore))

    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors (+config, tokenizer)")
    b.add_argument("--mcore-dir", required=True,
                   help="directory written by hf-to-mcore, a training checkpoint (run_dir/checkpoints/step_N), "
                        "or a megatron torch_dist (dist_checkpointing) checkpoint")
    b.add_argument("--hf-assets-dir", default=None,
                   help="HF directory whose config.json / tokenizer files go beside the weights (default: the "
                        "copy in --mcore-dir/hf_assets, or a training run's actor.load_hf; required for other "
                        "torch_dist checkpoints)")
    b.add_argument("--out", required=True, help="output HF model directory")
    b.add_argument("--merge", action="store_true",
                   help="a LoRA run: write the model with its adapters merged (default: the PEFT adapter alone)")
    b.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    b.set_defaults(func=_run(_mcore_to_hf))
