"""The thinking controls of the evaluation protocol on the embedded default (docs/design.md
section 4): thinking tokens distilled or not at an equal distilled-token budget, with the
planning text visible to later turns or hidden from them.

Arms of tg_jax.train.pipeline.ARMS: GRPO and TG (answer tokens only), `tg_think_budget` (TG
that also distils <think> tokens, per step at most TG's distilled-token count) and
`tg_think_hidden` (the same with `rl_loop.hide_thinking`: no assistant turn sees an earlier
turn's <think> block, in training and evaluation) and `tg_think_short` (the same with a
reasoning-length budget, `rl_loop.think_budget` = 2: the base's blocks are 5-6 tokens, the tag,
a family name and the closing tag), 3 training seeds each, from the demo's shipped base, with
the data, steps and rollouts of configs/default.py:
    python -m tg_jax.main --config=configs/thinking.py --workdir=./workdir_thinking

Hidden thinking trains one row per assistant turn (env.max_turns = 3 rows per episode), so its
train steps cost more; the report's costs section gives each arm's wall time.
"""

import os

from tg_jax import config_files

ARMS = ("grpo", "tg", "tg_think_budget", "tg_think_hidden", "tg_think_short")


def get_config(arg=None):
    del arg
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "default.py"))
    c.unlock()
    c.eval.train_seeds = (0, 1, 2)  # training seeds per arm
    c.pipeline.arms = ARMS
    return c
