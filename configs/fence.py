"""The code-fence requirement on the embedded default: configs/default.py with env fence.

Same data as configs/default.py and twice its RL steps (below); RL judges and TG teaches the
fence requirement (code in a ```python block) instead of the tool-call protocol:
    python -m tg_jax.main --config=configs/fence.py --workdir=./workdir_fence

The base model is shipped (tg_jax/bases/fence, provenance.json beside it): configs/default.py's
shipped base continued by SFT with forced fences (sft.init "default", below; ~6 min on 2 CPU
cores), written once by
    python -m tg_jax.ship_base --config=configs/fence.py --workdir=W --name=fence
and the same file on every machine (--config.sft.source=train trains it in the run instead).
Measured results: docs/experiments.md.

`configs/fence.py:runlocal` takes configs/tiny.py's model, task, SFT, loop and evaluation
sections (single-turn episodes): a CPU smoke run of the config in about a minute (the tests).

Why these choices:
  * The base continues configs/default.py's shipped base (sft.init), not a random init: 1500
    steps at the default's SFT lr, dev selection from step 500 (sft.select.start), the
    default's gates. SFT of this byte model from scratch is chaotic: on an AMD EPYC (family 25)
    three from-scratch fence bases solved 0.180 / 0.195 / 0.039 of held-out tasks, all under
    the 0.2 gate; the continued one solved 0.31 with hinted fence compliance 0.97 and no
    format cost (its provenance.json). At lr 1e-3 it kept the default base's hint-following
    (hinted fence compliance 0.92 / 0.93 after 1000-1500 steps, under the 0.95 gate).
  * Forced fences in SFT (sft.transcripts.p_forced 0.3, forced_requirements ("fence",)): 30%
    of the unhinted transcripts write their code fenced, the first backtick left out of the
    SFT loss. Without them the base model had seen fenced code only after a fence hint: made
    to open a fence unprompted it wrote malformed turns and solved half as many tasks, and TG,
    which teaches exactly that, lost ~0.1-0.15 of task success to GRPO. With them the base
    model continues a fence it did not choose as well as plain code, and still never opens
    one unprompted (GRPO stays at 0). A pretrained model is the same: it writes good Markdown
    once it has started, without choosing it unasked.
  * TG is configs/default.py's: the forward KL at lambda_tg 0.05, token-sum over 32
    trajectories x 50 tokens. The fence is decided at two tokens per turn (the first answer
    token and the one after the code), where the base model is sure of its own format and the
    hinted teacher of a backtick: there the reverse KL's and the JSD's gradients vanish (both
    saturate on near-disjoint distributions); the forward KL's is p_student - p_teacher.
  * lambda_tg 0.05: at 1.0 the forward KL's gradient is ~20x GRPO's and is clipped, the task
    reward stops counting and the policy degenerates (runs of backticks, task success ~0).
  * token_sum: at the start the same weight as the token mean (~1600 distilled tokens), then
    the TG term shrinks with the number of failed turns instead of putting the same weight on
    fewer tokens; one seed, docs/experiments.md.
  * 120 RL steps (configs/default.py: 40), the same for every arm. TG spends its first ~15
    steps switching the policy into the format, and only then do its GRPO updates learn to run
    the tests before submitting, which GRPO's own arm learns within ~20 steps. At 40 steps
    TG's policies tested ~40% less and lost 0.02-0.07 of task success to GRPO; at 80 they
    still tested less (1.1-1.3 vs 1.6-1.9 run_tests per episode, pre-registered seeds) and
    their testing was still rising; at 120, pre-registered, the fence's TG was non-inferior
    (+0.051 [+0.008, +0.094]) and tested 1.5 per episode against GRPO's 1.9, and with both
    requirements TG tested more than GRPO but missed the margin on three seeds (-0.034
    [-0.073, 0.008]) and passed on six pre-registered ones (+0.042 [+0.010, +0.075];
    docs/experiments.md).
  * The teacher is the current policy (tg.teacher_params "policy"): it drifts with it, so
    nothing here stops a longer run from drifting further. A teacher frozen at the base model
    (tg.teacher_params "reference") learnt the fence about as well over three seeds, at the
    same task success and ~2.3x the teacher FLOPs (full teacher rows); the policy's hinted
    compliance falls with either teacher, so that fall is not the teacher's drift
    (docs/experiments.md).
"""

import os

import ml_collections

from tg_jax import config_files


def get_config(arg=None):
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/fence.py takes no argument or 'runlocal', not {arg!r}")
    here = os.path.dirname(__file__)
    c = config_files.load_config_file(os.path.join(here, "default.py"))
    c.unlock()
    c.env.requirements = ("fence",)  # the requirement RL judges and TG teaches
    # The base model continues a fence it did not open as well as plain code (docstring).
    c.sft.transcripts.p_forced = 0.3
    c.sft.transcripts.forced_requirements = ("fence",)
    # The shipped base (tg_jax/bases/fence) and the recipe that made it: the default's shipped
    # base continued with forced fences (docstring).
    c.sft.source = "shipped"
    c.sft.base = "fence"
    c.sft.init = "default"
    c.sft.steps = 1500
    c.sft.select.start = 500
    # GRPO (both arms): task reward plus the fence reward.
    c.rl.reward_weights = ml_collections.ConfigDict({"task": 1.0, "fence": 0.5})
    # Targeted guidance: configs/default.py's forward KL at lambda_tg 0.05, token_sum (the
    # module docstring says why).
    # 120 RL steps for every arm: TG learns the format first, then to test (docstring).
    c.rl_loop.steps = 120
    if arg == "runlocal":
        tiny = config_files.load_config_file(os.path.join(here, "tiny.py"))
        transcripts = c.sft.transcripts
        for section in ("model", "tasks", "sft", "rl_loop", "eval"):
            c[section] = tiny[section]
        c.sft.transcripts.p_forced = transcripts.p_forced  # forced fences in the smoke run too
        c.sft.transcripts.forced_requirements = transcripts.forced_requirements
        c.env.max_turns = tiny.env.max_turns  # single-turn: the hinted rows fit the tiny context
    return c
