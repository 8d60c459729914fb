"""The code-fence requirement on the embedded default: configs/default.py with env fence.

Same data as configs/default.py and twice its RL steps (below); RL judges and TG teaches the
fence requirement (code in a ```python block) instead of the tool-call protocol:
    python -m tg_jax.main --config=configs/fence.py --workdir=./workdir_fence

The base model is shipped (tg_jax/bases/fence, provenance.json beside it): configs/default.py's
shipped base continued by SFT with forced fences (sft.init "default", below; ~6 min on 2 CPU
cores), written once by
    python -m tg_jax.ship_base --config=configs/fence.py --workdir=W --name=fence
and the same file on every machine (--config.sft.source=train trains it in the run instead).

`configs/fence.py:runlocal` takes configs/tiny.py's model, task, SFT, loop and evaluation
sections (single-turn episodes): a CPU smoke run of the config in about a minute (the tests).

Why these settings, and what they measured: docs/results.md ("Why the configs are set as they
are").
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
