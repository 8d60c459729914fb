"""Both requirements at once on the embedded default: the code fence and the tool-call protocol.

configs/fence.py (its TG recipe: forward KL, lambda_tg 0.05, token_sum) with env.requirements
("fence", "tool_json"): RL judges both, GRPO is rewarded for each, and TG puts one hint
message before every turn that breaks either, naming each requirement it broke (the message
the base model learnt to follow in SFT, where half the transcripts are hinted for either or
both). Compliance is reported per requirement and joint (both met):
    python -m tg_jax.main --config=configs/joint.py --workdir=./workdir_joint

The base model is configs/fence.py's recipe with both requirements forced in SFT
(sft.transcripts.forced_requirements: each unhinted forced transcript fences its code and
calls its tools in JSON, the token where each format starts left out of the SFT loss; why:
docs/results.md, "Why the configs are set as they are"), shipped as tg_jax/bases/joint:
    python -m tg_jax.ship_base --config=configs/joint.py --workdir=W --name=joint
Results: docs/results.md.

`configs/joint.py:runlocal`: configs/fence.py:runlocal's tiny sections, a CPU smoke run.
"""

import os

import ml_collections

from tg_jax import config_files


def get_config(arg=None):
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/joint.py takes no argument or 'runlocal', not {arg!r}")
    here = os.path.dirname(__file__)
    c = config_files.load_config_file(os.path.join(here, "fence.py"), arg or None)
    c.unlock()
    c.env.requirements = ("fence", "tool_json")
    c.sft.transcripts.forced_requirements = ("fence", "tool_json")  # each requirement TG teaches
    if arg != "runlocal":  # the smoke run trains its tiny base
        c.sft.base = "joint"  # shipped, made by the command above
    c.rl.reward_weights = ml_collections.ConfigDict({"task": 1.0, "fence": 0.5, "tool_json": 0.5})
    return c
