"""SFT of the base model on expert transcripts of the coding environment (docs/design.md section 3).

`run_sft(config, workdir)`:

 0. Picks the tokenizer (`sft.tokenizer`): the byte tokenizer, or a BPE trained on the
    train-split transcripts (`tg_jax.text.bpe`) and kept in `workdir/sft/tokenizer`, which a
    resumed run reuses; model.vocab_size then follows the BPE (`tokenized_config`).
 1. Builds the sharded model and a `TrainState` (params, AdamW state, step, rng; the same
    state type as the RL trainer, so RL starts from the SFT params directly).
 2. Restores the latest checkpoint of `workdir/sft/checkpoints` if any (resume); returns at
    once when it is the final step (a finished SFT is never redone).
 3. Generates and packs the transcripts (`tg_jax.train.sft_data`); batch `s` is a pure
    function of (data_seed, s), so a resumed run sees the same batches.
 4. Runs the jitted `sft_train_step` (batch sharded over the data axes, state donated),
    logs metrics one step late (JSONL + TensorBoard, stage "sft") with a progress bar, and
    checkpoints every `sft.checkpoint_every` steps, on preemption, and at the end.

The loss is the mean next-token cross-entropy over assistant tokens (THINK + ANSWER roles).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding, PartitionSpec

from tg_jax import checkpointing, config_files, paths, sharding, tracing
from tg_jax.metrics import LaggedMetrics, MetricsWriter
from tg_jax.models import ModelConfig, Transformer, forward, hf_dir
from tg_jax.progress import ProgressBar
from tg_jax.rl.train_state import (
    TrainState,
    abstract_train_state,
    create_train_state,
    make_lr_schedule,
    make_optimizer,
    train_state_shardings,
)
from tg_jax.text import ByteTokenizer, ChatRenderer, HFTokenizer, Tokenizer, bpe, byte_hf
from tg_jax.train import sft_eval, sft_select, shipped_base
from tg_jax.train.sft_data import (
    batch_indices,
    make_sft_rows,
    make_sft_transcripts,
    transcript_texts,
)
from tg_jax.train.sft_settings import check_tokenizer

Batch = dict[str, jax.Array]
SFT_DIR = "sft"
SUMMARY_FILE = "sft_summary.json"
TOKENIZER_DIR = "tokenizer"  # the BPE of sft.tokenizer = "bpe", in workdir/sft/


def sft_loss(
    logits_BxTxV: jax.Array, targets_BxT: jax.Array, mask_BxT: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Masked next-token cross-entropy.

    1. log-softmax of the logits in fp32;
    2. negative log-likelihood of each target;
    3. mean over the tokens where `mask_BxT` is 1 (the assistant tokens), so every assistant
       token of the batch weighs the same whatever the sequence it belongs to.

    Args:
      logits_BxTxV: logits at each input position.
      targets_BxT: the token each position predicts.
      mask_BxT: 1.0 on positions whose target counts, else 0.0.

    Returns:
      (loss, metrics) with metrics {"accuracy" (argmax == target on masked tokens),
      "num_tokens"}.
    """
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    nll_BxT = -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    mask_BxT = mask_BxT.astype(jnp.float32)
    num = jnp.maximum(mask_BxT.sum(), 1.0)
    loss = (nll_BxT * mask_BxT).sum() / num
    hit_BxT = (jnp.argmax(logits_BxTxV, axis=-1) == targets_BxT).astype(jnp.float32)
    return loss, {"accuracy": (hit_BxT * mask_BxT).sum() / num, "num_tokens": mask_BxT.sum()}


def sft_train_step(
    state: TrainState,
    batch: Batch,
    *,
    model: Transformer,
    optimizer: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on a packed batch (keys of `sft_data.PackedRows`, each [B, T])."""

    def loss_fn(params):
        logits_BxTxV = forward(
            model, params, batch["inputs"], batch["positions"], batch["segment_ids"]
        )
        return sft_loss(logits_BxTxV, batch["targets"], batch["loss_mask"])

    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = state.replace(
        params=optax.apply_updates(state.params, updates),
        opt_state=opt_state,
        step=state.step + 1,
    )
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "lr": lr_schedule(state.step),
        **aux,
    }
    return new_state, {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def sft_optimizer_config(config: Any) -> ml_collections.ConfigDict:
    """`config.sft.optim` with the schedule horizon set to `config.sft.steps`.

    The cosine always ends with SFT, even when `sft.steps` was overridden in a way that cut
    its link to `sft.optim.total_steps` (e.g. a copy made with `to_dict`).
    """
    optim = ml_collections.ConfigDict(config.sft.optim.to_dict())
    optim.total_steps = int(config.sft.steps)
    return optim


def extension_schedule(config: Any) -> optax.Schedule:
    """The lr of the steps after sft.steps (`sft.extend`): a cosine over `extend.steps` from
    `extend.lr_fraction` x lr down to the main schedule's end value (or no lower than it)."""
    optim = sft_optimizer_config(config)
    ext = sft_select.extend_config(config)
    base = int(config.sft.steps)
    peak = float(optim.lr) * ext.lr_fraction
    end = peak
    if optim.schedule == "warmup_cosine":
        end = min(peak, float(optim.lr) * float(optim.end_lr_fraction))
    cosine = optax.cosine_decay_schedule(peak, max(ext.steps, 1), alpha=end / peak)
    return lambda count: cosine(count - base)


def make_sft_step(config: Any, model: Transformer, mesh, rules, *, extension: bool = False):
    """(optimizer, step): `sft_train_step` jitted with explicit shardings, state donated.

    extension: the step of the steps after sft.steps (`extension_schedule`; the same optimizer
    state, so it continues the main run's).
    """
    optim_cfg = sft_optimizer_config(config)
    schedule = extension_schedule(config) if extension else make_lr_schedule(optim_cfg)
    optimizer = make_optimizer(optim_cfg, schedule if extension else None)
    state_sh = train_state_shardings(model, optimizer, mesh, rules)
    batch_sh = sharding.data_sharding(mesh, rules, ndim=1)  # a prefix: dim 0 of every leaf
    body = functools.partial(sft_train_step, model=model, optimizer=optimizer, lr_schedule=schedule)

    def fn(state, batch):
        with nn.logical_axis_rules(rules):
            return body(state, batch)

    jitted = tracing.jit(
        fn,
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())),
        donate_argnames="state",
    )

    def step(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    return optimizer, step


def tokenizer_kind(config: Any) -> str:
    """`config.sft.tokenizer`: "byte" (ByteTokenizer) or "bpe" (trained on the transcripts)."""
    return check_tokenizer(str(config.sft.get("tokenizer", "byte")))  # saved configs: .get


def tokenizer_dir(workdir: str) -> str:
    return os.path.join(workdir, SFT_DIR, TOKENIZER_DIR)


def _has_tokenizer(workdir: str) -> bool:
    return (paths.as_path(tokenizer_dir(workdir)) / hf_dir.TOKENIZER_FILE).exists()


def sft_tokenizer(config: Any, workdir: str) -> Tokenizer:
    """The base model's tokenizer: ByteTokenizer, or the BPE `prepare_tokenizer` wrote.

    The BPE's vocab_size (the model's) is its id count padded to a multiple of 8.

    Raises:
      FileNotFoundError: sft.tokenizer is "bpe" and `workdir` holds no trained BPE.
    """
    if tokenizer_kind(config) == "byte":
        return ByteTokenizer()
    directory = tokenizer_dir(workdir)
    if not _has_tokenizer(workdir):
        raise FileNotFoundError(f"no BPE tokenizer in {directory}: run the sft stage first")
    local = hf_dir.stage_locally(directory)
    num_ids = HFTokenizer.from_dir(local).vocab_size
    return HFTokenizer.from_dir(local, vocab_size=-(-num_ids // 8) * 8)


def prepare_tokenizer(config: Any, workdir: str) -> tuple[Tokenizer, list | None]:
    """(tokenizer, transcripts): `sft_tokenizer`, after training the BPE (sft.tokenizer "bpe",
    `sft.bpe_vocab_size` ids at most) on the SFT transcripts of the train split and writing
    it to `workdir/sft/tokenizer` when not there yet; the transcripts when made, else None."""
    transcripts = None
    if tokenizer_kind(config) == "bpe" and not _has_tokenizer(workdir):
        transcripts = make_sft_transcripts(config)
        texts = transcript_texts(transcripts, ChatRenderer(ByteTokenizer()))
        with tempfile.TemporaryDirectory(prefix="tg_bpe_") as tmp:
            bpe.write_bpe_tokenizer(
                tmp,
                texts,
                int(config.sft.bpe_vocab_size),
                model_max_length=int(config.model.max_seq_len),
            )
            hf_dir.copy_dir(tmp, tokenizer_dir(workdir))
    return sft_tokenizer(config, workdir), transcripts


def tokenized_config(config: Any, tokenizer: Tokenizer) -> Any:
    """`config` whose model.vocab_size is the BPE's (a copy); with the byte tokenizer,
    `config` itself (model.vocab_size covers ByteTokenizer's ids, `build_model` checks)."""
    if tokenizer_kind(config) == "byte":
        return config
    return config_files.apply_overrides(config, {"model.vocab_size": int(tokenizer.vocab_size)})


def write_tokenizer_files(config: Any, workdir: str, out_dir: str) -> None:
    """The base model's tokenizer as Hugging Face files (tokenizer.json, chat template, ...)
    in local directory `out_dir`: the byte tokenizer's, or the BPE's of `workdir`."""
    if tokenizer_kind(config) == "byte":
        byte_hf.write_byte_tokenizer(out_dir)
        return
    src = hf_dir.stage_locally(tokenizer_dir(workdir))
    for name in os.listdir(src):
        paths.as_path(os.path.join(src, name)).copy(paths.as_path(out_dir) / name, overwrite=True)


def build_model(config: Any, tokenizer: Tokenizer | None = None) -> Transformer:
    """The Transformer of `config.model`, checked against the tokenizer (default: the byte
    tokenizer) and the SFT rows."""
    model_cfg = ModelConfig.from_config(config.model)
    tokenizer = tokenizer or ByteTokenizer()
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size {model_cfg.vocab_size} < tokenizer vocab {tokenizer.vocab_size}"
        )
    if int(config.sft.seq_len) > model_cfg.max_seq_len:
        raise ValueError(
            f"sft.seq_len {config.sft.seq_len} > model.max_seq_len {model_cfg.max_seq_len}"
        )
    return Transformer(model_cfg)


def initial_params(config: Any, mesh, rules) -> Any:
    """The params SFT starts from: those of the shipped base `sft.init` (checked:
    `shipped_base.sft_init`), or None (a random init of `seed`)."""
    init = shipped_base.sft_init(config)
    if init is None:
        return None
    print(f"sft: starts from base {config.sft.init} (sha256 {init[1]['sha256'][:16]}...)")
    model_cfg = ModelConfig.from_config(config.model)
    return hf_dir.open_model_dir(init[0]).load_params(model_cfg, mesh=mesh, rules=rules)


def sft_checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, SFT_DIR, "checkpoints")


def sft_finished(config: Any, workdir: str) -> bool:
    """Whether `workdir` holds the final SFT checkpoint (its step is the run's last: sft.steps,
    or sft.steps + sft.extend.steps when the run was extended)."""
    directory = sft_checkpoint_dir(workdir)
    if not paths.as_path(directory).is_dir():
        return False
    final = sft_select.final_step(config, os.path.join(workdir, SFT_DIR))
    with checkpointing.TrainingCheckpointer(directory, read_only=True) as ckpt:
        return final is not None and ckpt.latest_step() == final


def run_sft(config: Any, workdir: str, *, stop_after: int | None = None) -> TrainState:
    """Trains (or resumes, or just loads) the base model; returns the final state.

    Args:
      config: full config (sections model, mesh, env, sft, seed).
      workdir: run directory; checkpoints in `workdir/sft/checkpoints`, metrics in
        `workdir/metrics.jsonl` (stage "sft") and `workdir/tb/sft`, a data/time summary in
        `workdir/sft/sft_summary.json`.
      stop_after: stop (with a checkpoint) once this many steps are done, as if preempted
        (tests of resume; None = run to the last step).

    Returns:
      The TrainState after the last step run (the restored one when SFT was already done).
    """
    t0 = time.time()
    tokenizer, transcripts = prepare_tokenizer(config, workdir)
    config = tokenized_config(config, tokenizer)
    tokenizer_s = time.time() - t0
    sft = config.sft
    model = build_model(config, tokenizer)
    mesh = sharding.make_mesh(config.mesh)
    rules = sharding.logical_rules(config.mesh)
    if int(sft.batch_size) % sharding.batch_divisor(mesh, rules):
        raise ValueError(
            f"sft.batch_size {sft.batch_size} is not a multiple of the mesh's batch split "
            f"{sharding.batch_divisor(mesh, rules)}"
        )
    optimizer, step_fn = make_sft_step(config, model, mesh, rules)
    ckpt = checkpointing.TrainingCheckpointer(
        sft_checkpoint_dir(workdir), max_to_keep=2, save_interval_steps=int(sft.checkpoint_every)
    )
    try:
        # sft.init's weights only for a fresh run (a checkpoint's are restored over the state).
        init = None if ckpt.latest_step() is not None else initial_params(config, mesh, rules)
        state = create_train_state(
            model, optimizer, mesh, rules, jax.random.key(int(config.seed)), params=init
        )
        restored = ckpt.restore_latest(state)
        start = 0
        if restored is not None:
            state, start = restored.state, restored.step
        if sft_finished(config, workdir):
            return selected_state(config, workdir, state)
        checkpointing.install_sigterm_handler()
        t0 = time.time()
        renderer = ChatRenderer(tokenizer)
        selector = sft_select.DevSelector(config, os.path.join(workdir, SFT_DIR), model, renderer)
        rows, stats = make_sft_rows(config, renderer, transcripts)
        data_s = tokenizer_s + time.time() - t0
        writer = MetricsWriter(workdir)
        if start == 0:
            writer.write(0, {f"data/{k}": v for k, v in stats.items()}, stage="sft_data")
        steps = {False: step_fn}  # by "after sft.steps": the extension's step built on demand

        def train(state, step):
            after = step >= int(sft.steps)
            if after not in steps:
                steps[after] = make_sft_step(config, model, mesh, rules, extension=after)[1]
            idx = batch_indices(rows.num_rows, int(sft.batch_size), step, int(sft.data_seed))
            return steps[after](state, rows.rows(idx))

        t1 = time.time()
        state, done = _sft_loop(config, state, start, stop_after, train, selector, ckpt, writer)
        _write_summary(workdir, stats, start, done, data_s, time.time() - t1)
        return selected_state(config, workdir, state) if done == selector.final_step else state
    finally:
        ckpt.close()


def _sft_loop(config, state, start, stop_after, train, selector, ckpt, writer):
    """The SFT steps from `start` to the run's last step (or `stop_after`, or a preemption),
    with the dev evaluations, the extension decision and the checkpoints; (state, steps done)."""

    def end_of(final):
        return final if stop_after is None else min(final, int(stop_after))

    lagged = LaggedMetrics(writer, stage="sft")
    bar = ProgressBar(
        selector.final_step,
        initial=start,
        keys=("loss", "accuracy"),
        desc="sft",
        log_every=int(config.sft.log_every),
    )
    done = start

    def decide(step):
        decision = selector.maybe_decide_extension(step)
        if decision is not None:
            bar.write(sft_select.describe_extension(decision))
            bar.set_total(selector.final_step)
        return end_of(selector.final_step)

    with writer, bar:
        if start > 0:  # a due evaluation (and decision) that a preemption skipped
            selector.maybe_evaluate(start, state)
        end = decide(start)
        while done < end:
            state, metrics = train(state, done)
            done += 1
            logged = lagged.push(done, metrics)
            bar.update(done, logged[1] if logged else None)
            preempted = checkpointing.preemption_requested(done)
            if not preempted and selector.maybe_evaluate(done, state) is not None:
                bar.write(sft_select.describe(selector.entries[-1]))
            if not preempted:
                end = decide(done)
            if preempted or done == end or ckpt.should_save(done):
                ckpt.save(done, state, metadata={"stage": "sft", "step": done}, force=True)
            if preempted:
                break
        lagged.flush()
    return state, done


def _write_summary(workdir, stats, start, done, data_s, train_s) -> None:
    """Appends this session's data statistics and timings to sft_summary.json."""
    path = paths.as_path(workdir) / SFT_DIR / SUMMARY_FILE
    sessions = []
    if path.exists():
        sessions = paths.read_json(path).get("sessions", [])
    sessions.append({"start_step": start, "end_step": done, "data_s": data_s, "train_s": train_s})
    total = sum(s["data_s"] + s["train_s"] for s in sessions)
    path.write_text(json.dumps({"data": stats, "sessions": sessions, "wall_s": total}, indent=2))


def read_sft_wall_s(workdir: str) -> float | None:
    """The SFT stage's wall time over all its sessions (sft_summary.json); None if not recorded."""
    path = paths.as_path(workdir) / SFT_DIR / SUMMARY_FILE
    if not path.exists():
        return None
    try:
        wall_s = paths.read_json(path).get("wall_s")
        return None if wall_s is None else float(wall_s)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a valid SFT summary: {e}") from e


def selected_step(config: Any, workdir: str) -> int:
    """The SFT step that is the base model: the dev-selected one, else the last step."""
    sft_dir = os.path.join(workdir, SFT_DIR)
    if config.sft.select.enabled and (paths.as_path(sft_dir) / sft_select.SELECTION_FILE).exists():
        best = sft_select.read_selection(sft_dir).get("best_step")
        if best is not None:
            return int(best)
    return last_step(config, workdir)


def last_step(config: Any, workdir: str) -> int:
    """The run's last SFT step: sft.steps, + sft.extend.steps when the run was extended."""
    final = sft_select.final_step(config, os.path.join(workdir, SFT_DIR))
    return int(config.sft.steps) if final is None else final


def write_sft_eval(config: Any, workdir: str, params: Any) -> dict:
    """Evaluates the base model on its dev tasks (`sft_eval.measure`) and writes
    `workdir/sft_eval.json`.

    The file also records what was measured: the requirements, the parameter count, the
    evaluation time and the SFT wall time (from sft/sft_summary.json when present).
    """
    tokenizer = sft_tokenizer(config, workdir)
    model_cfg = ModelConfig.from_config(tokenized_config(config, tokenizer).model)
    result = sft_eval.measure(config, model_cfg, params, ChatRenderer(tokenizer))
    result["selected_step"] = selected_step(config, workdir)
    result["sft_steps"] = last_step(config, workdir)  # sft.steps, + an extension if any
    if (paths.as_path(workdir) / SFT_DIR / SUMMARY_FILE).exists():
        result["sft_wall_s"] = read_sft_wall_s(workdir)
    (paths.as_path(workdir) / sft_eval.EVAL_FILE).write_text(json.dumps(result, indent=2))
    return result


def _checkpoint_of(config: Any, workdir: str, step: int) -> str:
    if step == last_step(config, workdir):
        return sft_checkpoint_dir(workdir)
    return os.path.join(workdir, SFT_DIR, sft_select.BEST_DIR)


def selected_state(config: Any, workdir: str, final: TrainState) -> TrainState:
    """The base model's TrainState: `final` itself, or the dev-selected checkpoint."""
    step = selected_step(config, workdir)
    if step == last_step(config, workdir):
        return final
    restored = checkpointing.restore_checkpoint(
        _checkpoint_of(config, workdir, step), final, step=step
    )
    return restored.state


def load_sft_state(config: Any, workdir: str, model: Transformer, mesh, rules) -> TrainState:
    """The final SFT TrainState of `workdir`, placed on `mesh` (RL starts from `.params`).

    Raises:
      CheckpointError: no finished SFT checkpoint there (run the `sft` stage first).
    """
    optimizer = make_optimizer(sft_optimizer_config(config))
    abstract = abstract_train_state(model, optimizer, mesh, rules)
    step = selected_step(config, workdir)
    restored = checkpointing.restore_checkpoint(
        _checkpoint_of(config, workdir, step), abstract, step=step
    )
    return restored.state
