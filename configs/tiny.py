"""Tiny config for tests and quick smoke runs (compiles in about a second on CPU).

Run its forward pass, a few SFT steps, or the whole main job in miniature:
    python -m tg_jax.main --config=configs/tiny.py --workdir=/tmp/tg_tiny --config.stage=forward
    python -m tg_jax.main --config=configs/tiny.py --workdir=/tmp/tg_tiny --config.stage=sft
    python -m tg_jax.main --config=configs/tiny.py --workdir=/tmp/tg_tiny --config.stage=pipeline
"""

import ml_collections

from tg_jax import config_lib


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.stage = "forward"  # which stage tg_jax.main runs
    c.seed = 0  # global seed
    c.model = config_lib.tiny_model_config()  # the Qwen3 architecture
    c.model.max_seq_len = 256  # room for hinted single-turn transcripts
    c.mesh = config_lib.mesh_config()  # device mesh and logical axis rules
    c.sampler_mesh = config_lib.sampler_mesh_config()  # sampler's own devices (0 = trainer's)
    c.tasks = config_lib.tasks_config(num_train=32, num_heldout=16)  # task sets
    # One requirement, single-turn episodes: short sequences.
    c.env = config_lib.env_config(requirements=("fence",), max_turns=1)  # environment
    c.sft = config_lib.sft_config(
        steps=6, batch_size=8, seq_len=256, num_transcripts=64, checkpoint_every=3, log_every=1
    )  # a few SFT steps on a few short transcripts
    c.sft.optim.warmup_steps = 1  # reach the peak lr at once
    c.sft.transcripts.max_chars = 200  # single-turn transcripts, hinted ones included
    c.sft.eval.num_tasks = 4  # held-out tasks per evaluation mode
    c.sft.eval.max_new_tokens = 16  # decode budget per turn
    c.sft.require.enabled = False  # a 6-step base model is outside any meaningful gate
    # Dev-set model selection at steps 3 and 6 on 4 tasks (exercised, not meaningful).
    c.sft.select.update(start=3, every=3, num_tasks=4, max_new_tokens=16)
    c.rl = config_lib.rl_config()  # GRPO
    c.tg = config_lib.tg_config()  # targeted guidance
    c.optim = config_lib.optim_config(lr=1e-3)  # RL optimizer (large: visible in a few steps)
    c.rl_loop = config_lib.tiny_loop_config(max_new_tokens=16)  # a few RL steps in seconds
    c.eval = config_lib.tiny_eval_config(max_new_tokens=16)  # held-out evaluation, 1 seed
    c.pipeline = config_lib.pipeline_config(arms=("grpo", "tg"))  # the main job
    c.pipeline.tune.update(val_tasks=8, samples_per_task=1)  # when trials are asked for
    return c
