"""SFT data: expert transcripts -> token ids with role codes -> packed [B, T] batches.

1. Transcripts are played in the run's environment on tasks of the TRAIN split only; held-out
   functions never appear in SFT data: the coding environment's synthetic expert
   (`tg_jax.envs.transcripts`), or with `env.kind` "swe" the SWE expert
   (`tg_jax.envs.swe.agents.make_swe_sft_transcripts`) on generated bug-fix repositories.
2. Each transcript renders with `ChatRenderer.render_with_roles`, append-only, exactly as a
   rollout builds its tokens. A hint is the transcript's own "user" message right before the
   turn it targets; it is rendered as a `hint` message (Role.HINT) so that the hinted
   sequences look like the teacher sequences of targeted guidance (hint right before the
   assistant header) and the model learns to follow a hint when one is in context.
3. Loss mask: the assistant tokens, i.e. THINK and ANSWER roles (the closing <|im_end|>
   included); prompt, hint and tool-observation tokens never count.
4. Packing: sequences are packed into rows of T tokens with per-sequence segment ids (1, 2,
   ...; 0 = padding) and positions restarting at 0, so attention never crosses sequences and
   every sequence sees the positions it would see alone. Inputs and targets are aligned per
   row: target t is the sequence's next token; the last token of a sequence has no target.
5. Batches are a pure function of (seed, step): batch `step` takes rows from the epoch's
   permutation, so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tg_jax.envs import env_kind, plugins
from tg_jax.envs.coding import CodingEnvConfig, coding_env_config
from tg_jax.envs.swe.agents import make_swe_sft_transcripts
from tg_jax.envs.swe.env import swe_env_config
from tg_jax.envs.swe.generator import generate_swe_tasks
from tg_jax.envs.tasks import generate_tasks
from tg_jax.envs.transcripts import Transcript, TranscriptConfig, make_transcripts
from tg_jax.text import ChatRenderer, Message, Role
from tg_jax.text.tokenizer import token_at_char

LOSS_ROLES = (int(Role.THINK), int(Role.ANSWER))


def transcript_messages(transcript: Transcript) -> list[Message]:
    """The transcript's messages with its hint messages marked as role "hint".

    In a transcript every "user" message after the first (the task prompt) is a hint placed
    right before the turn it targets; the renderer then gives its tokens Role.HINT.
    """
    out: list[Message] = []
    for i, m in enumerate(transcript.messages):
        role = "hint" if (m["role"] == "user" and i > 0) else m["role"]
        out.append({"role": role, "content": m["content"]})
        if m.get("no_loss_chars"):
            out[-1]["no_loss_chars"] = list(m["no_loss_chars"])
    return out


def render_example(renderer: ChatRenderer, messages: Sequence[Message]) -> tuple[np.ndarray, ...]:
    """Token ids [n] int32 and role codes [n] int8 of one conversation (append-only).

    The tokens that hold an assistant message's "no_loss_chars" (offsets in its content) get
    the PROMPT role, so that SFT does not learn to produce them (`loss_mask`).
    """
    ids, roles, owners = renderer.render_with_owners(messages)
    ids, roles, owners = np.asarray(ids, np.int32), np.asarray(roles, np.int8), np.asarray(owners)
    for i, m in enumerate(messages):
        offsets = m.get("no_loss_chars") if m["role"] == "assistant" else None
        if offsets:
            produced = np.flatnonzero((owners == i) & np.isin(roles, LOSS_ROLES))
            held = _content_tokens(renderer, m["content"], ids[produced], offsets, i)
            roles[produced[held]] = int(Role.PROMPT)
    return ids, roles


def _content_tokens(
    renderer: ChatRenderer, content: str, ids: np.ndarray, offsets: Sequence[int], i: int
) -> np.ndarray:
    """Indices in `ids` (message i's produced tokens, thinking and answer) of the tokens that
    hold characters `offsets` of its content."""
    ids = ids.tolist()
    if not renderer.tokenizer.decode(ids).startswith(content):
        raise ValueError(f"message {i}: its tokens do not decode to its content")
    out = []
    for o in offsets:
        if not 0 <= o < len(content):
            raise ValueError(f"message {i}: no_loss_chars offset {o} outside its content")
        out.append(token_at_char(renderer.tokenizer, ids, o))
    return np.asarray(out, np.int64)


def loss_mask(roles: np.ndarray) -> np.ndarray:
    """True on the tokens SFT learns to produce: assistant thinking and answer tokens."""
    return np.isin(roles, LOSS_ROLES)


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Packed SFT rows (numpy), all [N, T].

    Attributes:
      inputs: token ids fed to the model (pad_id in padding).
      targets: the next token of the same sequence (pad_id where there is none).
      loss_mask: 1.0 where the target is an assistant (THINK/ANSWER) token, else 0.0.
      positions: position of each input inside its own sequence.
      segment_ids: 1, 2, ... per sequence in the row, 0 in padding.
    """

    inputs: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.inputs.shape[0]

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at `index` as a batch dict."""
        return {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)}


def pack_examples(
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    pad_id: int,
    *,
    seed: int = 0,
    open_rows: int = 16,
) -> PackedRows:
    """Packs (ids, roles) sequences into rows of `seq_len` tokens.

    Sequences are visited in a seeded random order and go into the first of the last
    `open_rows` rows with room (a bounded first-fit: near-full rows at linear cost).

    Args:
      examples: (ids [n], roles [n]) per sequence; each n <= seq_len.
      seq_len: T, tokens per row.
      pad_id: id used for padding inputs and missing targets.
      seed: packing order.
      open_rows: how many recent rows are tried before opening a new one.

    Returns:
      PackedRows with N rows.

    Raises:
      ValueError: a sequence is longer than seq_len (its tail would be cut: make the model's
        context longer, or the transcripts shorter).
    """
    lengths = np.array([len(ids) for ids, _ in examples], np.int64)
    if len(lengths) and lengths.max() > seq_len:
        raise ValueError(
            f"an SFT sequence has {lengths.max()} tokens > seq_len {seq_len}: raise "
            "config.sft.seq_len (and model.max_seq_len) or lower the transcripts' max_chars"
        )
    order = np.random.default_rng(seed).permutation(len(examples))
    rows: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in order:
        n = int(lengths[i])
        first = max(0, len(rows) - open_rows)
        for r in range(first, len(rows)):
            if room[r] >= n:
                rows[r].append(int(i))
                room[r] -= n
                break
        else:
            rows.append([int(i)])
            room.append(seq_len - n)
    shape = (len(rows), seq_len)
    inputs = np.full(shape, pad_id, np.int32)
    targets = np.full(shape, pad_id, np.int32)
    mask = np.zeros(shape, np.float32)
    positions = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    for r, members in enumerate(rows):
        t = 0
        for seg, i in enumerate(members, start=1):
            ids, roles = examples[i]
            n = len(ids)
            inputs[r, t : t + n] = ids
            targets[r, t : t + n - 1] = ids[1:]
            mask[r, t : t + n - 1] = loss_mask(roles[1:])
            positions[r, t : t + n] = np.arange(n)
            segments[r, t : t + n] = seg
            t += n
    return PackedRows(inputs, targets, mask, positions, segments)


def transcript_config(cfg: Any) -> TranscriptConfig:
    """TranscriptConfig from `config.sft.transcripts`."""
    return TranscriptConfig.from_config(cfg)


def hint_requirements(config: Any, requirements: Sequence[str]) -> tuple[str, ...]:
    """`config.sft.hint_requirements`: the requirements whose hints the SFT transcripts show
    (those the base model learns to follow); empty = the built-in ones of `requirements` (the
    environment's). A scripted expert cannot write turns that meet a plug-in's rule, and a
    transcript showing its hint without following it would teach ignoring it.

    Raises:
      ValueError: a plug-in among them.
    """
    hinted = tuple(config.sft.get("hint_requirements", ()) or ())
    hinted = hinted or plugins.builtin_names(requirements)
    if any(plugins.is_plugin(n) for n in hinted):
        raise ValueError(
            f"sft.hint_requirements {hinted}: the expert transcripts can follow only the "
            "built-in requirements, not plug-ins"
        )
    return hinted


def transcript_env_config(config: Any) -> CodingEnvConfig:
    """The environment the expert transcripts are played in: `config.env` with the in-process
    executor (our own code) and the requirements the transcripts hint (`hint_requirements`)."""
    cfg = coding_env_config(config.env, executor="trusted")
    return dataclasses.replace(cfg, requirements=hint_requirements(config, cfg.requirements))


def make_sft_transcripts(config: Any) -> list[Transcript]:
    """The expert transcripts of `config`, on tasks of the train split only.

    Args:
      config: the full config (sections `tasks` (its families), `env`, `sft`).
    """
    sft = config.sft
    if env_kind(config.env) == "swe":
        return _swe_transcripts(config)
    tasks = generate_tasks(
        "train", int(sft.num_transcripts), seed=int(sft.data_seed), families=config.tasks.families
    )
    # Our own expert code: the in-process executor gives the sandbox's observations, faster.
    return make_transcripts(
        tasks,
        seed=int(sft.data_seed),
        config=transcript_config(sft.transcripts),
        env_config=transcript_env_config(config),
        families=tuple(config.tasks.families),
    )


def _swe_transcripts(config: Any) -> list[Transcript]:
    """The SWE expert's transcripts: `sft.num_transcripts` generated train repositories (the
    approved share of `tasks`), the targets `hint_requirements` hinted in a share
    `sft.transcripts.p_hinted` of them; the other transcript knobs are the coding expert's and
    do not apply."""
    sft = config.sft
    env_config = swe_env_config(config.env)
    targets = hint_requirements(config, env_config.requirements)
    approved = float(config.tasks.get("approved_share", 0.0))
    n, seed = int(sft.num_transcripts), int(sft.data_seed)
    return make_swe_sft_transcripts(
        generate_swe_tasks("train", n, seed=seed, approved_share=approved),
        seed,
        targets=targets,
        p_hinted=float(sft.transcripts.p_hinted),
        env_config=env_config,
    )


def transcript_texts(transcripts: Sequence[Transcript], renderer: ChatRenderer) -> list[str]:
    """The text of each transcript as SFT renders it (what a tokenizer is trained on)."""
    tok = renderer.tokenizer
    return [tok.decode(render_example(renderer, transcript_messages(t))[0]) for t in transcripts]


def make_sft_rows(
    config: Any, renderer: ChatRenderer, transcripts: Sequence[Transcript] | None = None
) -> tuple[PackedRows, dict[str, float]]:
    """Generates the SFT transcripts of `config` (unless given) and packs them.

    Args:
      config: the full config (sections `tasks` (its families), `env`, `sft`).
      renderer: chat renderer of the model's tokenizer.
      transcripts: `make_sft_transcripts(config)`, when already made.

    Returns:
      (rows, stats): the packed rows and a few data statistics (to log).
    """
    sft = config.sft
    if transcripts is None:
        transcripts = make_sft_transcripts(config)
    rendered = [render_example(renderer, transcript_messages(t)) for t in transcripts]
    # The few transcripts longer than a row are left out (counted) rather than cut.
    keep = [i for i, (ids, _) in enumerate(rendered) if len(ids) <= int(sft.seq_len)]
    examples = [rendered[i] for i in keep]
    transcripts = [transcripts[i] for i in keep]
    rows = pack_examples(examples, int(sft.seq_len), renderer.tokenizer.pad_id, seed=sft.data_seed)
    lengths = np.array([len(ids) for ids, _ in examples])
    stats = {
        "num_transcripts": len(transcripts),
        "num_too_long": len(rendered) - len(keep),
        "num_rows": rows.num_rows,
        "tokens": int(lengths.sum()),
        "loss_tokens": int(rows.loss_mask.sum()),
        "packing_efficiency": float(lengths.sum() / rows.inputs.size),
        "max_len": int(lengths.max()),
        "mean_len": float(lengths.mean()),
        "frac_correct": float(np.mean([t.correct for t in transcripts])),
        "frac_hinted": float(np.mean([t.hinted for t in transcripts])),
        "frac_forced": float(np.mean([_forced(t) for t in transcripts])),
    }
    return rows, stats


def _forced(transcript: Transcript) -> bool:
    return any(m.get("no_loss_chars") for m in transcript.messages)


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of batch `step`: consecutive slices of per-epoch seeded permutations.

    A pure function of its arguments, so resuming at step s needs no iterator state.
    """
    if num_rows < batch_size:
        raise ValueError(f"{num_rows} packed rows < batch size {batch_size}: add transcripts")
    per_epoch = num_rows // batch_size  # the last partial slice of an epoch is dropped
    epoch, k = divmod(int(step), per_epoch)
    perm = np.random.default_rng((int(seed), epoch)).permutation(num_rows)
    return perm[k * batch_size : (k + 1) * batch_size]
