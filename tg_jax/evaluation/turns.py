"""What each assistant turn of the coding environment does, by its position in the episode.

The report counts actions per episode (a policy that runs the tests less); this says where:
for the first turn, the second, and the third and later ones, the share of episodes that
reach it, the share of its judged turns that meet every requirement judged on them, the share
that write code, and the tool each calls (run_tests, submit, or none: a malformed turn). A
policy that submits at its first turn instead of testing, or whose later turns break a format
its first turns keep, shows here.

    python -m tg_jax.evaluation.turns --config=configs/joint.py --workdir=W \\
        --model_dir=W/export/grpo_seed0 --model_dir=W/export/tg_seed0

plays held-out episodes (plain prompts, the config's eval settings) with each checkpoint
directory and prints one table per model; `--out` writes the profiles as JSON.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tg_jax import paths
from tg_jax.envs.protocol import parse_turn
from tg_jax.evaluation import heldout_reads
from tg_jax.sampling.trajectory import Trajectory
from tg_jax.text import ChatRenderer

POSITIONS = ("1st", "2nd", "3rd+")


def turn_text(traj: Trajectory, renderer: ChatRenderer, turn: int) -> str:
    """The text the policy wrote in assistant turn `turn` (its end-of-turn tokens dropped)."""
    ids = np.asarray(traj.tokens)[np.asarray(traj.turn_ids) == turn]
    end = set(renderer.end_of_turn_ids)
    return renderer.tokenizer.decode([int(i) for i in ids if int(i) not in end])


def turn_profile(trajectories: Sequence[Trajectory], renderer: ChatRenderer) -> list[dict]:
    """Per position (`POSITIONS`: the last one pools every later turn):

    episodes: the share of the episodes that reach that turn (for "3rd+": the third);
    turns: how many turns were seen there; pass: the share of the judged turns (a requirement
    applied) that met every requirement judged on them (None when none was judged);
    code / run_tests / submit / no_tool: the shares of the turns that write code, call each
    tool, or call none (malformed).
    """
    n = max(len(trajectories), 1)
    seen = [{"met": [], "tools": [], "code": []} for _ in POSITIONS]
    for t in trajectories:
        for k in range(t.num_turns):
            at = seen[min(k, len(POSITIONS) - 1)]
            if (met := t.turn_met(k)) is not None:
                at["met"].append(met)
            parsed = parse_turn(turn_text(t, renderer, k))
            at["tools"].append(parsed.tool)
            at["code"].append(bool(parsed.code))
    rows = []
    for p, (name, at) in enumerate(zip(POSITIONS, seen, strict=True)):
        tools, m = at["tools"], max(len(at["tools"]), 1)
        rows.append(
            {
                "turn": name,
                "episodes": sum(t.num_turns > p for t in trajectories) / n,
                "turns": len(tools),
                "pass": float(np.mean(at["met"])) if at["met"] else None,
                "code": sum(at["code"]) / m,
                "run_tests": tools.count("run_tests") / m,
                "submit": tools.count("submit") / m,
                "no_tool": tools.count(None) / m,
            }
        )
    return rows


def format_profile(rows: Sequence[dict]) -> str:
    """The profile as an aligned text table."""
    out = ["turn  episodes  turns  pass  code  run_tests  submit  no_tool"]
    for r in rows:
        ok = "  -  " if r["pass"] is None else f"{r['pass']:.2f}"
        out.append(
            f"{r['turn']:4s}  {r['episodes']:8.2f}  {r['turns']:5d}  {ok}  {r['code']:.2f}  "
            f"{r['run_tests']:9.2f}  {r['submit']:6.2f}  {r['no_tool']:7.2f}"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="config file (its env and eval), FILE or FILE:ARG"
    )
    parser.add_argument("--workdir", required=True, help="workdir holding the tfds/ task sets")
    parser.add_argument(
        "--model_dir",
        required=True,
        action="append",
        help="checkpoint directory to profile (repeat for several)",
    )
    parser.add_argument("--num_tasks", type=int, default=0, help="0 = config.eval.num_tasks")
    parser.add_argument("--samples", type=int, default=0, help="0 = config.eval.samples_per_task")
    heldout_reads.add_split_flags(parser)
    parser.add_argument("--out", default="", help="write the profiles as JSON here")
    args = parser.parse_args(argv)

    from tg_jax import config_files  # noqa: PLC0415
    from tg_jax.evaluation import heldout  # noqa: PLC0415
    from tg_jax.models import ModelConfig, hf_dir  # noqa: PLC0415

    path, _, arg = args.config.partition(":")
    base = config_files.load_config_file(path, arg or None)
    result: dict[str, Any] = {}
    try:  # the same tasks for every model, read once
        n = args.num_tasks or base.eval.num_tasks
        tasks = heldout_reads.analysis_tasks(base, args.workdir, args, n, "tg_jax.evaluation.turns")
    except heldout_reads.HeldoutReadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for model_dir in args.model_dir:
        md = hf_dir.open_model_dir(model_dir)
        config = hf_dir.resolve_config(base, md)
        params = md.load_params(ModelConfig.from_config(config.model))
        records, trajs = heldout.heldout_episodes(
            config,
            params,
            tasks,
            conditions=("plain",),
            samples_per_task=args.samples or None,
            sampler=heldout.make_sampler(config, md.renderer),
            renderer=md.renderer,
        )
        rows = turn_profile(trajs, md.renderer)
        success = float(np.mean([r.task_success for r in records])) if records else 0.0
        result[model_dir] = {"episodes": len(records), "task_success": success, "turns": rows}
        print(f"{model_dir}: {len(records)} {args.split} episodes, task success {success:.3f}")
        print(format_profile(rows))
    if args.out:  # a local path or gs://
        paths.write_json_atomic(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
