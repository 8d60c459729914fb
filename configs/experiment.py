"""The full evaluation protocol on the embedded default (docs/design.md section 4).

Same data, base model and RL budget as configs/default.py; the protocol's arms of
tg_jax.train.pipeline.ARMS (GRPO, TG, TG with thinking tokens, the task-reward-only pair
grpo_task_only / tg_no_req_reward, the other ablations and the two stress tests: imperfect
hints and a judge that errs) with 3 training seeds each, at the same budget (the report's
"Equal tuning budget" section states it; no setting is tuned on the held-out tasks):
    python -m tg_jax.main --config=configs/experiment.py --workdir=./workdir_experiment

RL starts from the demo's shipped base (tg_jax/bases/default). The demo's workdir itself is
refused once it holds the demo's preregistration.json (other arms and seeds: a new protocol
needs a new workdir). The report lands in workdir_experiment/report/report.md (measured
results: docs/results.md). The peers' methods are compared in configs/peers.py.
"""

import os

from tg_jax import config_files

# Named, not "every arm of ARMS": a new arm there must not change a registered protocol.
ARMS = (
    "grpo", "grpo_task_only", "tg", "tg_think", "tg_think_budget", "tg_all_turns",
    "tg_no_req_reward", "tg_lambda_high", "tg_lambda_low", "tg_stress", "tg_wrong_judge",
)  # fmt: skip


def get_config(arg=None):
    del arg
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "default.py"))
    c.unlock()
    c.eval.train_seeds = (0, 1, 2)  # training seeds per arm
    c.pipeline.arms = ARMS  # the protocol's arms
    return c
