"""TG among its peers on the embedded default: the same teacher path, equal budgets.

The arms of tg_jax.train.pipeline.ARMS for the peers' methods (tg.method, tg_jax.rl.peers):
SDPO (a convex blend of GRPO and self-distillation on every turn), OPSD (privileged context on
every turn: TG with the all-turns gate), SDAR (a sigmoid-gated distillation term) and SGCD (no
KL: the teacher reweights the GRPO advantages), beside GRPO and TG, 3 training seeds each.
Same data, base model, steps, rollouts and sampled-token budget as configs/default.py; only
the loss differs (the report's "Equal tuning budget" and costs sections state it):
    python -m tg_jax.main --config=configs/peers.py --workdir=./workdir_peers
"""

import os

from tg_jax import config_files

ARMS = ("grpo", "tg", "sdpo", "opsd", "sdar", "sgcd")


def get_config(arg=None):
    del arg
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "default.py"))
    c.unlock()
    c.eval.train_seeds = (0, 1, 2)  # training seeds per arm
    c.pipeline.arms = ARMS
    return c
