"""A checkpoint as a judge, served by the built-in engine: a rubric about each turn, answered
yes or no (`tg_jax.envs.judge`).

    judge = ModelJudge("gs://bucket/Qwen3-8B", "Is the reply polite to the user?")
    judge(["Sure, here it is.", "Figure it out yourself."])     # -> [True, False] (a good judge)

Each turn becomes a conversation in the judge's own chat template (`ChatRenderer` of its
directory: the template renders it, thinking off where the template has the switch): the
rubric as the system message, then `prompt` with the turn's text in it as the user message.
The batch is decoded greedily on one `Engine` (continuous batching over a paged pool, `slots`
at once), each answer at most `max_new_tokens` tokens, read by `parse_verdict` (its first word
"yes" or "no"; anything else, or a turn too long for the context, is None: unjudged). The
checkpoint is read at the first batch (in the `BatchingJudge`'s thread), not when the judge is
made, so a plug-in module can make its judged requirement at import; a directory without a
config.json is refused when the judge is made (a plug-in's is then an error at start-up). The
frozen reference as a judge is the run's base checkpoint directory; its weights are a second
copy beside the policy's.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from tg_jax import paths
from tg_jax.engine.engine import Engine
from tg_jax.engine.requests import Request
from tg_jax.envs.judge import parse_verdict
from tg_jax.models import hf_dir
from tg_jax.models.qwen3 import Transformer

PROMPT = (
    "Judge the following reply by the rubric. Answer with one word, yes or no.\n\nReply:\n{turn}"
)


class ModelJudge:
    """Turn texts -> verdicts from a checkpoint answering a rubric (module docstring).

    Attributes:
      model_dir: the checkpoint directory (local or gs://); rubric: the system message;
      answers: the judge's raw answer of every turn judged so far, by turn text (for audits).
    """

    def __init__(
        self,
        model_dir: str,
        rubric: str,
        *,
        prompt: str = PROMPT,
        max_new_tokens: int = 8,
        slots: int = 32,
        max_context: int = 2048,
        page_size: int = 16,
    ):
        if "{turn}" not in prompt:
            raise ValueError("ModelJudge prompt must contain '{turn}' (where the turn goes)")
        if min(max_new_tokens, slots, max_context, page_size) < 1:
            raise ValueError("ModelJudge sizes must be >= 1")
        if not (paths.as_path(model_dir) / "config.json").exists():
            raise ValueError(
                f"ModelJudge: {model_dir} is not a checkpoint directory (no config.json)"
            )
        self.model_dir, self.rubric, self.prompt = str(model_dir), str(rubric), prompt
        self.max_new_tokens, self.slots = int(max_new_tokens), int(slots)
        self.max_context, self.page_size = int(max_context), int(page_size)
        self.answers: dict[str, str] = {}
        self._lock = threading.Lock()  # the engine's load and each batch
        self._engine: Engine | None = None
        self._md: Any = None
        self._ids = itertools.count()

    def _load(self) -> Engine:
        md = hf_dir.open_model_dir(self.model_dir)
        cfg = md.architecture
        params = md.load_params(cfg)
        pages = -(-min(self.max_context, cfg.max_seq_len) // self.page_size)
        self._md = md
        return Engine(
            Transformer(cfg),
            params,
            max_slots=self.slots,
            page_size=self.page_size,
            max_pages_per_seq=pages,
            pad_id=md.tokenizer.pad_id,
            prefill_chunk=64,
            prefill_rows=min(4, self.slots),
        )

    def prompt_ids(self, turn: str) -> list[int]:
        """The token ids the judge reads for `turn` (its template's rendering)."""
        messages = [
            {"role": "system", "content": self.rubric},
            {"role": "user", "content": self.prompt.format(turn=turn)},
        ]
        return self._md.renderer.render_prompt(messages, enable_thinking=False)

    def __call__(self, texts: Sequence[str]) -> list[bool | None]:
        with self._lock:
            if self._engine is None:
                self._engine = self._load()
            md, engine = self._md, self._engine
            stops = tuple(dict.fromkeys((*md.renderer.end_of_turn_ids, *md.stop_ids)))
            requests = [
                Request(
                    next(self._ids),
                    self.prompt_ids(t),
                    self.max_new_tokens,
                    temperature=0.0,
                    stop_ids=stops,
                )
                for t in texts
            ]
            done = engine.generate(requests)
            for r in requests:
                engine.release(r.request_id)
            out = []
            for text, c in zip(texts, done, strict=True):
                ids = [i for i in c.token_ids if i not in stops]
                answer = md.tokenizer.decode(ids) if c.finish_reason != "error" else ""
                self.answers[text] = answer
                out.append(parse_verdict(answer) if answer else None)
            return out


__all__ = ["PROMPT", "ModelJudge"]
