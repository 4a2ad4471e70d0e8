"""``python -m megatron_rl.tasks OUT_DIR [--task copy] [--seed 0] [--hidden-size 128] [--num-layers 2]``: build a
tiny Qwen2 task model plus the char tokenizer (see ``char_tokenizer.build_task_model``) and print its path."""
from megatron_rl.tasks.char_tokenizer import main

if __name__ == "__main__":
    main()
