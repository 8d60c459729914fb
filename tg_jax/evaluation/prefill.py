"""What a format costs a model once it writes in it: held-out episodes whose first answer is
opened with the format's opening text, against plain episodes.

The hinted condition of the held-out evaluation answers another question: it shows a hint
before every turn, so it also measures reading hints (and, before a turn the hint does not
concern, e.g. a submit without code, a context the hinted SFT data never had). Prefilling the
first turn's answer with the opening (e.g. "```python\\n") puts the model in the format where
it would choose it, with no hint, and lets it write the rest: the situation of a TG policy
that has learnt to open the format. By default the opening replaces the first turn's
thinking block; `--after_thinking` keeps the block the model writes and opens the format
after it, where a thinking policy decides its format (what sft_eval's format cost measures):

    python -m tg_jax.evaluation.prefill --config=configs/fence.py --workdir=W \\
        --model_dir=W/base_model --prefill='```python\\n' --after_thinking

prints, for plain and prefilled episodes: task success (95% cluster bootstrap CI), each
requirement's compliance, the share of episodes that ran the tests, malformed turns per
episode; `--out` writes them as JSON.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tg_jax import paths
from tg_jax.evaluation import heldout_reads
from tg_jax.sampling.episode import EpisodeRecord
from tg_jax.sampling.rows import stop_lists
from tg_jax.sampling.sampler import SampleResult
from tg_jax.text import ChatRenderer
from tg_jax.text.chat import THINK_END, THINK_START


class PrefillSampler:
    """Wraps a sampler: a prompt that ends the conversation's first assistant header gets the
    prefill tokens appended and returned as the first tokens of the turn (log-prob 0, as
    forced tokens); every other prompt is sampled unchanged.

    With `after_thinking`, a first turn that opens with a thinking block keeps it: the turn is
    sampled up to its </think>, then `separator` + the prefill is forced and the rest sampled;
    a first turn without a thinking block is opened with the prefill as above, and one whose
    block does not close (budget, end of turn) is kept as sampled. That is where a policy that
    thinks before it writes a format stands. Calls then run without the rollout's turn cache
    (a forced turn is not one continuation of its prompt), the same tokens up to float
    rounding.
    """

    def __init__(
        self,
        sampler: Any,
        renderer: ChatRenderer,
        prefill: str,
        *,
        after_thinking: bool = False,
        separator: str = "\n",
    ):
        if not prefill:
            raise ValueError("the prefill text is empty")
        self.sampler = sampler
        self.prefill = renderer.tokenizer.encode(prefill)
        self.after_thinking = bool(after_thinking)
        self.forced_after = renderer.tokenizer.encode(separator + prefill)
        self._think = (
            renderer.tokenizer.special_id(THINK_START),
            renderer.tokenizer.special_id(THINK_END),
        )
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
        if self.after_thinking:
            return self._sample_after_thinking(params, prompts, first, budgets, kw)
        out = self.sampler.sample(
            params,
            [list(p) + (self.prefill if f else []) for p, f in zip(prompts, first, strict=True)],
            max_new_tokens=[int(b) - (n if f else 0) for b, f in zip(budgets, first, strict=True)],
            **kw,
        )

        def lead(rows, values):
            return [
                np.concatenate([np.asarray(values if f else [], r.dtype), r])
                for r, f in zip(rows, first, strict=True)
            ]

        zeros = [0.0] * n
        return SampleResult(
            lead(out.tokens, self.prefill),
            lead(out.logprobs, zeros),
            lead(out.raw_logprobs, zeros),
            out.stopped,
            out.prefill_tokens,
        )

    def _sub(self, params, prompts, rows, budgets, kw, *, stop_ids, rng):
        """The inner sampler on `rows` only (their prompts, budgets, stop lists, row ids)."""
        row_ids = kw.get("row_ids")
        extra = {k: v for k, v in kw.items() if k not in ("stop_ids", "rng", "row_ids")}
        return self.sampler.sample(
            params,
            [prompts[i] for i in rows],
            max_new_tokens=[int(budgets[i]) for i in rows],
            stop_ids=[list(stop_ids[i]) for i in rows],
            rng=rng,
            row_ids=None if row_ids is None else [row_ids[i] for i in rows],
            **extra,
        )

    def _sample_after_thinking(self, params, prompts, first, budgets, kw):
        kw = {k: v for k, v in kw.items() if k not in ("cache", "keys")}
        per_row = [tuple(s) for s in stop_lists(kw.get("stop_ids", ()), len(prompts))]
        rng = kw["rng"]
        prompts = [list(p) for p in prompts]
        # Phase 1: every row as usual, the first turns stopping at their </think> as well.
        stop1 = [s + (self._think[1],) if f else s for s, f in zip(per_row, first, strict=True)]
        out = self._sub(params, prompts, range(len(prompts)), budgets, kw, stop_ids=stop1, rng=rng)
        tokens = [np.asarray(t) for t in out.tokens]
        lps, raw = [np.asarray(x) for x in out.logprobs], [np.asarray(x) for x in out.raw_logprobs]
        stopped = np.asarray(out.stopped).copy()
        thought, bare = [], []
        for i, t in enumerate(tokens):
            if not first[i]:
                continue
            if len(t) and t[0] == self._think[0]:
                closed = bool(stopped[i]) and t[-1] == self._think[1]
                room = int(budgets[i]) - len(t) - len(self.forced_after)
                if closed and room > 0:
                    thought.append(i)
                elif closed:
                    stopped[i] = False  # no room left for the format: the turn hit its budget
            else:
                bare.append(i)
        # Phase 2: the thinking turns keep their block and continue after separator + prefill,
        # forced; phase 3: the first turns without a thinking block are opened with the prefill
        # instead (their phase-1 sample dropped).
        phases = ((thought, True, self.forced_after), (bare, False, self.prefill))
        for phase, (rows, keep_head, lead) in enumerate(phases, start=1):
            if not rows:
                continue
            head = {i: len(tokens[i]) if keep_head else 0 for i in rows}
            conts = {i: prompts[i] + tokens[i][: head[i]].tolist() + lead for i in rows}
            rest = {i: int(budgets[i]) - head[i] - len(lead) for i in rows}
            o = self._sub(
                params, conts, rows, rest, kw, stop_ids=per_row, rng=jax.random.fold_in(rng, phase)
            )
            zeros = np.zeros(len(lead), np.float32)
            for k, i in enumerate(rows):
                n, forced = head[i], np.asarray(lead, o.tokens[k].dtype)
                tokens[i] = np.concatenate([tokens[i][:n], forced, o.tokens[k]])
                lps[i] = np.concatenate([lps[i][:n], zeros, o.logprobs[k]])
                raw[i] = np.concatenate([raw[i][:n], zeros, o.raw_logprobs[k]])
                stopped[i] = o.stopped[k]
        return SampleResult(tokens, lps, raw, stopped, None)


def summarize(records: Sequence[EpisodeRecord], seed: int = 0) -> dict[str, Any]:
    """Task success (mean, cluster bootstrap CI), compliance per requirement, share of episodes
    that ran the tests, malformed turns per episode."""
    from tg_jax.evaluation import stats  # noqa: PLC0415

    if not records:
        raise ValueError("no records")
    success = np.array([float(r.task_success) for r in records])
    ci = stats.bootstrap_ci(
        success, clusters_N=[r.cluster_id or r.task_id for r in records], seed=seed
    )
    names = sorted({n for r in records for n in r.compliance})
    return {
        "episodes": len(records),
        "task_success": ci.mean,
        "task_success_ci": [ci.low, ci.high],
        "compliance": {
            n: float(np.mean([r.compliance.get(n, False) for r in records])) for n in names
        },
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
    after_thinking: bool = False,
) -> dict[str, dict[str, Any]]:
    """{"plain": summary, "prefilled": summary} of the held-out episodes of `tasks`: the same
    sampling seed for both, the prefilled ones with the first answer opened by `prefill`. Both
    are played lock-step (a forced opening wraps the lock-step sampler), whatever
    `rl_loop.rollout_engine` says."""
    from tg_jax.evaluation import heldout  # noqa: PLC0415

    if "rl_loop" in config:
        config = config.copy_and_resolve_references()
        config.rl_loop.rollout_engine = "lockstep"
    sampler = heldout.make_sampler(config, renderer)
    out = {}
    forced = PrefillSampler(sampler, renderer, prefill, after_thinking=after_thinking)
    for name, s in (("plain", sampler), ("prefilled", forced)):
        records = heldout.evaluate_heldout(
            config,
            params,
            tasks,
            conditions=("plain",),
            samples_per_task=samples_per_task,
            sampler=s,
            renderer=renderer,
        )
        out[name] = summarize(records)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="config file (its env and eval), FILE or FILE:ARG"
    )
    parser.add_argument("--workdir", required=True, help="workdir holding the tfds/ task sets")
    parser.add_argument("--model_dir", required=True, help="checkpoint directory to evaluate")
    parser.add_argument(
        "--prefill",
        required=True,
        help="text opening the first answer (backslash escapes such as \\n are decoded)",
    )
    parser.add_argument(
        "--after_thinking",
        action="store_true",
        help="open the format after "
        "the first turn's thinking block (else at the turn's start, in its "
        "place)",
    )
    parser.add_argument("--num_tasks", type=int, default=0, help="0 = config.eval.num_tasks")
    parser.add_argument("--samples", type=int, default=0, help="0 = config.eval.samples_per_task")
    heldout_reads.add_split_flags(parser)
    parser.add_argument("--out", default="", help="write the summaries as JSON here")
    args = parser.parse_args(argv)

    from tg_jax import config_files  # noqa: PLC0415
    from tg_jax.models import ModelConfig, hf_dir  # noqa: PLC0415

    prefill = codecs.decode(args.prefill, "unicode_escape")
    path, _, arg = args.config.partition(":")
    config = config_files.load_config_file(path, arg or None)
    md = hf_dir.open_model_dir(args.model_dir)
    config = hf_dir.resolve_config(config, md)
    params = md.load_params(ModelConfig.from_config(config.model))
    try:
        tasks = heldout_reads.analysis_tasks(
            config,
            args.workdir,
            args,
            args.num_tasks or config.eval.num_tasks,
            "tg_jax.evaluation.prefill",
        )
    except heldout_reads.HeldoutReadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = evaluate_prefill(
        config,
        params,
        tasks,
        md.renderer,
        prefill,
        samples_per_task=args.samples or None,
        after_thinking=args.after_thinking,
    )
    where = "after the first thinking block" if args.after_thinking else "at the first answer"
    print(f"prefill {prefill!r} {where}, {len(tasks)} {args.split} tasks, model {args.model_dir}")
    for name, s in result.items():
        comp = " ".join(f"{n} {v:.2f}" for n, v in s["compliance"].items())
        lo, hi = s["task_success_ci"]
        print(
            f"  {name:9s} task_success {s['task_success']:.3f} [{lo:.3f}, {hi:.3f}]  "
            f"compliance {comp}  ran tests {s['ran_tests']:.2f}  "
            f"malformed/episode {s['malformed_per_episode']:.2f}"
        )
    if args.out:  # a local path or gs://
        out = {
            "prefill": prefill,
            "after_thinking": args.after_thinking,
            "model_dir": args.model_dir,
            **result,
        }
        paths.write_json_atomic(args.out, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
