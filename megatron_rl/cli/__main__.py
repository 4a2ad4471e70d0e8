"""``python -m megatron_rl.cli ...`` == the ``megatron-rl`` console script."""
import sys

from megatron_rl.cli import main

sys.exit(main())
