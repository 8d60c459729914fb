"""RL from your own Hugging Face checkpoint on the software-engineering environment.

    python -m tg_jax.main --config=configs/hf_swe.py --workdir=W --config.model.hf_checkpoint=DIR

configs/hf_tg.py with `env.kind = "swe"` (tg_jax.envs.swe): each task is a small repository
to fix with file tools and real test runs (generated bug-fix repositories, or your own tasks:
--config.tasks.train_source=tasks.jsonl --config.tasks.heldout_source=heldout_dir/), and
the policy is judged on the tool protocol, a Markdown report with the diff, naming exactly
the changed files, and asking before overwriting a file. Longer episodes than the coding
environment's: 16k-token student rows plus the teachers' hints.

`configs/hf_swe.py:runlocal` shrinks it so a tiny checkpoint runs on a CPU (the tests use it).
"""

import os

import ml_collections

from tg_jax import config_files, config_lib

REQUIREMENTS = ("tool_protocol", "markdown_report", "files_named", "ask_first")


def get_config(arg=None):
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "hf_tg.py"), arg)
    with c.unlocked():
        c.tasks = config_lib.swe_tasks_config()  # generated bug-fix repositories
        c.env = config_lib.swe_env_config(
            max_turns=16, max_tokens=12_000, max_wall_s=600.0, tools_in_prompt=True
        )
        weights = {"task": 1.0, **dict.fromkeys(REQUIREMENTS, 0.25)}
        c.rl.reward_weights = ml_collections.ConfigDict(weights)
        if arg == "runlocal":
            c.tasks = config_lib.swe_tasks_config(num_train=8, num_heldout=4)
            c.env = config_lib.swe_env_config(max_turns=2, max_observation_chars=300)
            return c
        # 16k-token student rows; the hints of 4 requirements x 16 turns fit in the rest.
        c.model.max_seq_len = 16_384 + 4096
        c.rl_loop.seq_len = 16_384
        c.rl_loop.max_new_tokens = 1024
        c.eval.max_new_tokens = 1024
    return c
