"""The SWE environment on the embedded default's byte model: bug-fix repositories, real tests.

    python -m tg_jax.main --config=configs/swe.py --workdir=./workdir_swe

configs/default.py with `env.kind = "swe"` (tg_jax.envs.swe): each task is a small generated
repository to fix with file tools (list, read, replace, write, ask the user, run the tests,
submit). RL judges four requirements and TG teaches explain_change, one of the third tier
(in conflict with the task); the report counts the side effects of both third-tier
requirements per arm:
  * explain_change (the target): explain each edit in a sentence in the turn that makes it;
    explaining instead of editing is the side effect "stopped_after_explain".
  * ask_first: ask the user before overwriting a file. Half of the overwrite tasks say the
    change is already approved (tasks.approved_share): asking there anyway is the side effect
    "asked_when_approved"; asking and then not editing is "stopped_after_ask". The base model
    meets it unprompted (its SFT transcripts ask on every unapproved overwrite), so the arms
    are compared on whether teaching explain_change moves it.
tool_protocol and files_named (the report names exactly the changed files) are met by the
base model unprompted too.

The base model is trained in the run (sft.source "train"): configs/default.py's shipped base
continued by SFT on the SWE expert's transcripts (tg_jax.envs.swe.agents
.make_swe_sft_transcripts: half of them hinted, meeting the target right after its hint; the
others not meeting it). Its transcripts are 1.4k bytes at the median (2k at the 99th
percentile), so rows are 2048 tokens, 4x the default's (about an hour of SFT on 2 CPU cores).

Why ask_first is not a target, and what this recipe measured: docs/results.md ("Why the
configs are set as they are").

`configs/swe.py:runlocal` takes configs/tiny.py's model (from a random init), loop and
evaluation sections, 2-turn episodes and a few SFT steps: a CPU smoke run of the whole main job
on the SWE environment in about two minutes (the tests).
"""

import os

import ml_collections

from tg_jax import config_files, config_lib

REQUIREMENTS = ("tool_protocol", "files_named", "ask_first", "explain_change")
TARGETS = ("explain_change",)  # hinted in SFT, taught by TG


def get_config(arg=None):
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/swe.py takes no argument or 'runlocal', not {arg!r}")
    here = os.path.dirname(__file__)
    c = config_files.load_config_file(os.path.join(here, "default.py"))
    c.unlock()
    c.tasks = config_lib.swe_tasks_config(num_train=512, num_heldout=64, approved_share=0.5)
    c.env = config_lib.swe_env_config(
        requirements=REQUIREMENTS, max_turns=8, max_observation_chars=600
    )
    # Context: RL reserves room for the hints of every requirement before every turn of a
    # teacher row (8 turns x 4 hints, ~2.3k byte tokens) on top of the student's rows; with
    # 2560 the students would get 264 tokens (tg_jax.train.rl_setup.max_lengths). SFT rows
    # stay 2048.
    c.model.max_seq_len = 4608
    c.sft.source = "train"
    c.sft.init = "default"  # continues the shipped default base (the chat format, tool calls)
    c.sft.steps = 2000
    c.sft.extend.steps = 0
    c.sft.seq_len = 2048
    c.sft.batch_size = 2
    c.sft.num_transcripts = 3000
    c.sft.hint_requirements = TARGETS
    c.sft.transcripts.p_hinted = 0.5
    c.sft.select.enabled = False
    c.sft.eval.num_tasks = 64
    c.sft.eval.max_new_tokens = 768  # a write_file turn carries the whole module
    # The generated repositories' held-out code is new (other templates and names): the byte
    # model is not expected to fix much of it, so the pass-rate gate is open.
    c.sft.require.pass_rate = (0.0, 1.0)
    c.sft.retry_seeds = 0
    c.rl.reward_weights = ml_collections.ConfigDict(
        {"task": 1.0, **dict.fromkeys(REQUIREMENTS, 0.25)}
    )
    c.rl_loop.max_new_tokens = 768
    c.eval.max_new_tokens = 768
    if arg == "runlocal":
        tiny = config_files.load_config_file(os.path.join(here, "tiny.py"))
        for section in ("model", "rl_loop", "eval"):
            c[section] = tiny[section]
        c.model.max_seq_len = 2560
        c.tasks.update(num_train=8, num_heldout=4)
        c.env.max_turns = 2
        c.sft.init = ""  # the tiny model is not the default base's architecture
        # 2-turn transcripts (~550 tokens), 8 rows a step (a multiple of 8 simulated devices).
        c.sft.update(steps=2, batch_size=8, seq_len=1024, num_transcripts=24, checkpoint_every=2,
                     log_every=1)  # fmt: skip
        c.sft.eval.update(num_tasks=2, max_new_tokens=16)
        c.sft.require.enabled = False
    return c
