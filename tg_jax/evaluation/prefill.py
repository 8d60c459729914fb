"""What a format costs a model once it writes in it: held-out episodes whose first answer is
opened with the format's opening text, against plain episodes.

The hinted condition of the held-out evaluation answers another question: it shows a hint
before every turn, so it also measures reading hints (and, before a turn the hint does not
concern, e.g. a submit without code, a context the hinted SFT data never had). Prefilling the
first turn's answer with the opening (e.g. "```python\\n") puts the model in the format where
it would choose it, with no hint, and lets it write the rest: the situation of a TG policy
that has learnt to open the format. The opening replaces the first turn's thinking block.

    python -m tg_jax.evaluation.prefill --config=configs/fence.py --workdir=W \\
        --model_dir=W/base_model --prefill='```python\\n'

prints, for plain and prefilled episodes: task success (95% cluster bootstrap CI), each
requirement's compliance, the share of episodes that ran the tests, malformed turns per
episode; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.sampler import SampleResult
from tg_jax.text import ChatRenderer


class PrefillSampler:
    """Wraps a sampler: a prompt that ends the conversation's first assistant header gets the
    prefill tokens appended and returned as the first tokens of the turn (log-prob 0, as
    forced tokens); every other prompt is sampled unchanged."""

    def __init__(self, sampler: Any, renderer: ChatRenderer, prefill: str):
        if not prefill:
            raise ValueError("the prefill text is empty")
        self.sampler = sampler
        self.prefill = renderer.tokenizer.encode(prefill)
        self._header = renderer.tokenizer.decode(renderer.assistant_header())
        self._decode = renderer.tokenizer.decode

    def _first_turn(self, prompt: Sequence[int]) -> bool:
        return self._decode(list(prompt)).count(self._header) == 1

    def sample(self, params: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens, **kw):
        first = [self._first_turn(p) for p in prompts]
        if not any(first):
            return self.sampler.sample(params, prompts, max_new_tokens=max_new_tokens, **kw)
        n = len(self.prefill)
        budgets = np.broadcast_to(np.asarray(max_new_tokens), (len(prompts),))
        if any(f and int(b) <= n for f, b in zip(first, budgets, strict=True)):
            raise ValueError(f"the prefill ({n} tokens) leaves no room in the turn's budget")
        out = self.sampler.sample(
            params,
            [list(p) + (self.prefill if f else []) for p, f in zip(prompts, first, strict=True)],
            max_new_tokens=[int(b) - (n if f else 0) for b, f in zip(budgets, first, strict=True)],
            **kw,
        )

        def lead(rows, values):
            return [np.concatenate([np.asarray(values if f else [], r.dtype), r])
                    for r, f in zip(rows, first, strict=True)]  # fmt: skip

        zeros = [0.0] * n
        return SampleResult(
            lead(out.tokens, self.prefill), lead(out.logprobs, zeros),
            lead(out.raw_logprobs, zeros), out.stopped, out.prefill_tokens,
        )  # fmt: skip


def summarize(records: Sequence[EpisodeRecord], seed: int = 0) -> dict[str, Any]:
    """Task success (mean, cluster bootstrap CI), compliance per requirement, share of episodes
    that ran the tests, malformed turns per episode."""
    from tg_jax.evaluation import stats  # noqa: PLC0415

    if not records:
        raise ValueError("no records")
    success = np.array([float(r.task_success) for r in records])
    ci = stats.bootstrap_ci(success, clusters_N=[r.cluster_id or r.task_id for r in records],
                            seed=seed)  # fmt: skip
    names = sorted({n for r in records for n in r.compliance})
    return {
        "episodes": len(records),
        "task_success": ci.mean,
        "task_success_ci": [ci.low, ci.high],
        "compliance": {
            n: float(np.mean([r.compliance.get(n, False) for r in records])) for n in names
        },  # fmt: skip
        "ran_tests": float(np.mean([r.actions.get("run_tests", 0) > 0 for r in records])),
        "malformed_per_episode": float(np.mean([r.actions.get("malformed", 0) for r in records])),
    }


def evaluate_prefill(
    config: Any,
    params: Any,
    tasks: Sequence[Any],
    renderer: ChatRenderer,
    prefill: str,
    *,
    samples_per_task: int | None = None,
) -> dict[str, dict[str, Any]]:
    """{"plain": summary, "prefilled": summary} of the held-out episodes of `tasks`: the same
    sampling seed for both, the prefilled ones with the first answer opened by `prefill`."""
    from tg_jax.evaluation import heldout  # noqa: PLC0415

    sampler = heldout.make_sampler(config, renderer)
    out = {}
    for name, s in (("plain", sampler), ("prefilled", PrefillSampler(sampler, renderer, prefill))):
        records = heldout.evaluate_heldout(
            config, params, tasks, conditions=("plain",), samples_per_task=samples_per_task,
            sampler=s, renderer=renderer,
        )  # fmt: skip
        out[name] = summarize(records)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="config file (its env and eval), FILE or FILE:ARG")  # fmt: skip
    parser.add_argument("--workdir", required=True, help="workdir holding the tfds/ task sets")
    parser.add_argument("--model_dir", required=True, help="checkpoint directory to evaluate")
    parser.add_argument("--prefill", required=True, help="text opening the first answer "
                        "(backslash escapes such as \\n are decoded)")  # fmt: skip
    parser.add_argument("--num_tasks", type=int, default=0, help="0 = config.eval.num_tasks")
    parser.add_argument("--samples", type=int, default=0, help="0 = config.eval.samples_per_task")
    parser.add_argument("--out", default="", help="write the summaries as JSON here")
    args = parser.parse_args(argv)

    from tg_jax import config_lib  # noqa: PLC0415
    from tg_jax.models import ModelConfig, hf_dir  # noqa: PLC0415
    from tg_jax.train import data_stage  # noqa: PLC0415

    prefill = codecs.decode(args.prefill, "unicode_escape")
    path, _, arg = args.config.partition(":")
    config = config_lib.load_config_file(path, arg or None)
    md = hf_dir.open_model_dir(args.model_dir)
    config = hf_dir.resolve_config(config, md)
    params = md.load_params(ModelConfig.from_config(config.model))
    sources = data_stage.prepare_tasks(config, args.workdir)
    tasks = data_stage.load_tasks(sources, "heldout", args.num_tasks or config.eval.num_tasks)
    result = evaluate_prefill(config, params, tasks, md.renderer, prefill,
                              samples_per_task=args.samples or None)  # fmt: skip
    print(f"prefill {prefill!r}, {len(tasks)} held-out tasks, model {args.model_dir}")
    for name, s in result.items():
        comp = " ".join(f"{n} {v:.2f}" for n, v in s["compliance"].items())
        lo, hi = s["task_success_ci"]
        print(f"  {name:9s} task_success {s['task_success']:.3f} [{lo:.3f}, {hi:.3f}]  "
              f"compliance {comp}  ran tests {s['ran_tests']:.2f}  "
              f"malformed/episode {s['malformed_per_episode']:.2f}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"prefill": prefill, "model_dir": args.model_dir, **result}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
