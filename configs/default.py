"""The embedded default (DESIGN.md section 3): data -> SFT base model -> GRPO vs TG -> report.

Run the whole main job (11.4 minutes measured on an idle 2-core CPU):
    python -m tg_jax.main --config=configs/default.py --workdir=./workdir

One stage only (data | sft | pipeline | forward); outputs in ./workdir: tfds/, sft/,
sft_eval.json (the base model), runs/<arm>_seed<s>/, report/report.md:
    python -m tg_jax.main --config=configs/default.py --workdir=./workdir --config.stage=sft

The pipeline caches: a workdir that holds the finished SFT checkpoint skips SFT, an unfinished
one resumes it.

Measured with these defaults (one run, idle 2-core CPU, 2026-11-30):
  * SFT 2500 steps in 284 s. Base model on 128 held-out tasks: pass rate 0.22 at temperature
    1, 0.27 greedy (hinted: 0.27 / 0.18); tool_json compliance 0.00 unprompted, 0.99 hinted
    (1.00 greedy). The same settings reproduced these pass rates exactly in a second run;
    another data and model seed (sft.data_seed=2, seed=1) gave 0.21 / 0.28, compliance
    0.01 unprompted, 0.99 hinted.
  * 40 RL steps per arm: GRPO 122 s, TG 148 s. Held-out (128 tasks x 2 samples, plain
    prompts): compliance TG 0.98 [0.96, 0.99] vs GRPO 0.00; task success TG 0.32
    [0.26, 0.39] vs GRPO 0.31 [0.25, 0.38]; paired difference +0.012 [-0.051, 0.074], so
    non-inferiority at margin -0.05 fails by 0.001 with one seed (configs/experiment.py runs
    3 seeds per arm).

Why these choices (each measured on the SFT base model, TG arm only, shared machine):
  * tasks.families = EASY_FAMILIES (constant copied from f(0)): with the two-parameter
    families the base model solved 0.05-0.09 after 3000 SFT steps.
  * The requirement is tool_json. The fence requirement is implemented and the base model
    follows its hint (0.98-1.00), but TG did not teach it stably: reverse KL left it at 0.00
    after 20 steps (its gradient vanishes where the student is sure of `def` and the teacher
    of a backtick); forward KL (lr 2e-4 / 3e-4, with or without a 0.1 reference KL) raised it
    to 0.3-0.4 by steps 20-27, then the policy wrote runs of 4-5 backticks with no code
    (malformed turns 1.4-2.8 per episode) and task success fell to ~0; JSD(0.5) at lr 3e-4
    learnt tool_json (1.00) with task success intact but left fence at 0.00 after 40 steps.
  * JSD(0.5), lr 3e-4, 4 groups x 8 rollouts: learnt the requirement in ~20 steps without
    degenerate outputs; 4 groups learnt as fast per step as 8, at half the step time.
"""

import ml_collections

from tg_jax import config_lib
from tg_jax.train import rl_config, stage_configs


def get_config(arg=None):
    del arg
    c = ml_collections.ConfigDict()
    c.stage = "pipeline"  # which stage tg_jax.main runs: data | sft | pipeline | forward
    c.seed = 0  # global seed (model init, sampling)
    # Byte-level Qwen3-style model, 2 layers, d_model 128 (0.43M params); the context covers
    # the longest SFT transcript (512 tokens) and the hinted teacher sequences of RL (up to
    # ~600 tokens). scan_unroll=2: both layers unrolled (params stay stacked), faster SFT
    # steps on CPU (`python -m tg_jax.bench --suite quick --sections train`: unroll_speedup).
    # attn_query_block stays 0 here. With --config.model.attn_query_block=128 the SFT stage
    # took 226 s instead of 284 s (sft_eval.json: sft_wall_s), but although the two attentions
    # agree to float rounding, that SFT ended at a base model with pass rate 0.02 (0.00 greedy)
    # instead of 0.22: the recipe is that sensitive to its trajectory. Results below are for 0.
    c.model = config_lib.model_config(num_layers=2, max_seq_len=768, scan_unroll=2)
    c.mesh = config_lib.mesh_config()  # device mesh and logical axis rules
    c.tasks = stage_configs.tasks_config()  # train / held-out task sets (data stage)
    # The requirement RL judges and TG teaches: the JSON tool-call protocol. (The fence
    # requirement is implemented too; see the module docstring for why it is not the default.)
    c.env = stage_configs.env_config(requirements=("tool_json",))
    c.sft = stage_configs.sft_config(steps=2500)  # SFT of the base model and its evaluation
    # The base model learns to follow both hints (fence and tool_json) when they are shown.
    c.sft.hint_requirements = ("fence", "tool_json")
    # Half the transcripts hinted: with 0.3 the hinted base model solved far fewer tasks than
    # the plain one (0.05 vs 0.23 greedy), and that teacher dragged TG's task success down.
    c.sft.transcripts.p_hinted = 0.5
    # GRPO (both arms): task reward plus the requirement's reward, so the GRPO baseline is
    # rewarded for compliance too (it just never samples it from this base model).
    c.rl = config_lib.rl_config(
        reward_weights=ml_collections.ConfigDict({"task": 1.0, "tool_json": 0.5})
    )
    # Targeted guidance (the TG arm): JSD(0.5). The base model puts ~all its mass on its own
    # format where the hinted teacher switches; the reverse KL's gradient vanishes there, and
    # the forward KL learnt the switch but drove degenerate outputs (see the module docstring).
    c.tg = config_lib.tg_config(kind="jsd", beta=0.5)
    c.optim = config_lib.optim_config(lr=3e-4)  # RL optimizer (both arms)
    # The RL loop: 40 steps of 4 groups x 8 rollouts. Batch lengths in multiples of 128 tokens:
    # few distinct shapes, so few compiles.
    c.rl_loop = rl_config.loop_config(
        steps=40, groups_per_step=4, eval_every=10, length_multiple=128
    )
    # Final held-out evaluation, NI margin, report; one training seed per arm (the main job's
    # budget; configs/experiment.py runs 3).
    c.eval = rl_config.eval_config(train_seeds=(0,))
    c.pipeline = ml_collections.ConfigDict()  # the main job
    c.pipeline.arms = ("grpo", "tg")  # RL arms (tg_jax.train.pipeline.ARMS), same budget each
    return c
