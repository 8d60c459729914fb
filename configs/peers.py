"""TG among its peers on an embedded config: the same teacher path, equal budgets.

The arms of tg_jax.train.pipeline.ARMS for the peers' methods (tg.method, tg_jax.rl.peers):
SDPO (a convex blend of GRPO and self-distillation on every turn), OPSD (privileged context on
every turn: TG with the all-turns gate), SDAR (a sigmoid-gated distillation term) and SGCD (no
KL: the teacher reweights the GRPO advantages), beside GRPO and TG, 3 training seeds each.
Same data, base model, steps, rollouts and sampled-token budget as the config it is built on;
only the loss differs (the report's "Equal tuning budget" and costs sections state it).
The argument names that config: configs/default.py (the tool-call protocol, no argument) or
configs/fence.py (the code-fence requirement, 120 RL steps per arm):
    python -m tg_jax.main --config=configs/peers.py --workdir=./workdir_peers
    python -m tg_jax.main --config=configs/peers.py:fence --workdir=./workdir_peers_fence
"""

import os

from tg_jax import config_files

ARMS = ("grpo", "tg", "sdpo", "opsd", "sdar", "sgcd")
BASES = ("default", "fence")


def get_config(arg=None):
    base = arg or "default"
    if base not in BASES:
        raise ValueError(f"configs/peers.py takes one of {BASES} (or nothing), not {arg!r}")
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), f"{base}.py"))
    c.unlock()
    c.eval.train_seeds = (0, 1, 2)  # training seeds per arm
    c.pipeline.arms = ARMS
    return c
