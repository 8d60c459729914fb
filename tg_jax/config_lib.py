"""Every config section, and loading / overriding of `configs/*.py` files.

Config files (`configs/NAME.py`) define `get_config(arg=None)` returning a locked
`ml_collections.ConfigDict` assembled from the section builders below (model, mesh,
sampler_mesh, tasks, env, transcripts, sft, sft_eval, rl, tg, optim, rl_loop, eval). Locking
makes an override of an unknown key fail with the key's name, and ConfigDict's type safety
makes an override of the wrong type fail. Code never mutates a config: derived values are
computed where they are needed. The sections that jitted code reads are made typed and
validated once, at the boundary (`tg_jax.models.ModelConfig`, `tg_jax.rl.step_config`).

Defaults are those of the embedded CPU run (configs/default.py); the `tiny_*` builders and
configs/tiny.py shrink them for tests.
"""

from __future__ import annotations

from typing import Any

import ml_collections

from tg_jax import config_schema
from tg_jax.data.task_settings import SweTasksConfig, TasksConfig
from tg_jax.envs.coding import CodingEnvConfig
from tg_jax.envs.swe.env import SweEnvConfig
from tg_jax.envs.transcripts import TranscriptConfig
from tg_jax.evaluation.report_settings import EvalConfig
from tg_jax.mesh_settings import MeshConfig, SamplerMeshConfig
from tg_jax.models.config import ModelConfig
from tg_jax.rl.step_config import OptimConfig, RLConfig, TGConfig
from tg_jax.train.loop_settings import LoopConfig, PipelineConfig
from tg_jax.train.sft_settings import ExtendConfig, RequireConfig, SelectConfig, SftEvalConfig


def mesh_config(shape=(1, -1, 1, 1)) -> ml_collections.ConfigDict:
    """Mesh axes, sizes (one may be -1 = the rest of the devices) and logical rules (the
    fields: `tg_jax.mesh_settings.MeshConfig`)."""
    return MeshConfig.config_dict(shape=tuple(shape))


def sampler_mesh_config(num_devices: int = 0, shape=(-1, 1)) -> ml_collections.ConfigDict:
    """The sampler's own devices and mesh (the fields: `tg_jax.mesh_settings.SamplerMeshConfig`)."""
    return SamplerMeshConfig.config_dict(num_devices=num_devices, shape=tuple(shape))


# The embedded CPU model (a byte tokenizer: 256 bytes + special tokens, padded to a multiple
# of 8); the fields and their meaning: tg_jax.models.ModelConfig.
CPU_MODEL = ModelConfig(
    vocab_size=272, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
    mlp_dim=384, rope_theta=10_000.0, tie_embeddings=True, max_seq_len=512,
)  # fmt: skip


def model_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The model section: the architecture (`tg_jax.models.ModelConfig`'s fields; defaults =
    `CPU_MODEL`) and two run settings."""
    c = config_schema.config_dict(CPU_MODEL)
    # A Hugging Face checkpoint directory (local or gs://) to start from: its config.json gives
    # the architecture (fields set here must agree), its files the weights, tokenizer and chat
    # template (tg_jax.models.hf_dir). "" = no checkpoint: a random init of this architecture.
    c.hf_checkpoint = ""
    # How the model writes tool calls (tg_jax.text.tool_formats: hermes, qwen3_coder, or one a
    # user registers); "" = the registered format that reads back what the chat template writes.
    c.tool_format = ""
    c.update(overrides)
    return c


def hf_model_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The model section of a run from `hf_checkpoint`: architecture fields unset (None, filled
    from its config.json; setting one makes it a checked expectation), run settings here."""
    c = model_config()
    for name in (
        "vocab_size",
        "d_model",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "mlp_dim",
        "num_experts",
        "experts_per_token",
        "moe_mlp_dim",
        "max_seq_len",
    ):
        c[name] = ml_collections.config_dict.placeholder(int)
    for name in ("rope_theta", "rms_norm_eps", "router_aux_loss_coef"):
        c[name] = ml_collections.config_dict.placeholder(float)
    for name in ("tie_embeddings", "norm_topk_prob"):
        c[name] = ml_collections.config_dict.placeholder(bool)
    c.update(overrides)
    return c


def tiny_model_config() -> ml_collections.ConfigDict:
    """A model that compiles and runs in well under a second on CPU, for tests."""
    return model_config(
        vocab_size=272, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=64, max_seq_len=128,
    )  # fmt: skip


def rl_config(**overrides: Any) -> ml_collections.ConfigDict:
    """GRPO: advantages, clipped surrogate, aggregation, reference KL, staleness, micro-batches
    (the fields: `tg_jax.rl.step_config.RLConfig`)."""
    return RLConfig.config_dict(**overrides)


def tg_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Targeted guidance: divergence, estimator, gating, lambda schedule, teacher context, and
    tg.method (tg | the peers' sdpo, opsd, sdar, sgcd on the same teacher path,
    `tg_jax.rl.peers`) with its fields (the fields: `tg_jax.rl.step_config.TGConfig`)."""
    return TGConfig.config_dict(**overrides)


def optim_config(**overrides: Any) -> ml_collections.ConfigDict:
    """AdamW with global-norm clipping and a learning-rate schedule (the fields:
    `tg_jax.rl.step_config.OptimConfig`)."""
    return OptimConfig.config_dict(**overrides)


def tasks_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The task sets of the data stage (the fields: `tg_jax.data.task_settings.TasksConfig`)."""
    return TasksConfig.config_dict(**overrides)


def env_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The coding environment (the fields: `tg_jax.envs.coding.CodingEnvConfig`); `kind`
    picks the environment tg_jax.envs.make_env builds (coding | swe)."""
    return CodingEnvConfig.config_dict(**{"kind": "coding", **overrides})


def swe_env_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The software-engineering environment (the fields: `tg_jax.envs.swe.env.SweEnvConfig`)."""
    return SweEnvConfig.config_dict(**{"kind": "swe", **overrides})


def swe_tasks_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The SWE task sets (the fields: `tg_jax.data.task_settings.SweTasksConfig`)."""
    return SweTasksConfig.config_dict(**overrides)


def transcripts_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Knobs of the synthetic expert (the fields: `tg_jax.envs.transcripts.TranscriptConfig`)."""
    return TranscriptConfig.config_dict(**overrides)


def sft_config(steps: int = 3000, **overrides: Any) -> ml_collections.ConfigDict:
    """SFT of the base model: data, batches, optimizer, checkpoints, evaluation.

    Why many small steps: after learning the format the byte model plateaus until attention
    learns to copy numbers out of the prompt, and that takes optimizer steps, not tokens.
    """
    c = ml_collections.ConfigDict()
    c.steps = steps  # train steps
    c.batch_size = 2  # packed rows per step (a multiple of the mesh's batch split)
    # Tokens per packed row (<= model.max_seq_len); attention cost grows with it, and longer
    # transcripts (< 0.5% at max_chars 800) are left out.
    c.seq_len = 512
    c.num_transcripts = 12_000  # expert transcripts, one per drawn train task (~1 epoch)
    c.data_seed = 1  # seed of the SFT tasks, transcripts, packing and batch order
    # The weights SFT starts from: "" = a random init of `seed`; else a shipped base (a name
    # under tg_jax/bases, or its directory) that SFT continues (sft.tokenizer "byte").
    c.init = ""
    # Requirements whose hints appear in the SFT transcripts (the hints the base model learns
    # to follow); empty = env.requirements. RL judges and teaches env.requirements only.
    c.hint_requirements = ()
    c.transcripts = transcripts_config()  # the synthetic expert's knobs
    # The base model's tokenizer: "byte" (ByteTokenizer) or "bpe" (a byte-level BPE trained on
    # the train-split transcripts, tg_jax.text.bpe; model.vocab_size then follows it).
    c.tokenizer = "byte"
    c.bpe_vocab_size = 512  # "bpe": ids at most (bytes, specials, fences, merges)
    c.optim = optim_config(
        lr=5e-3, weight_decay=0.01, schedule="warmup_cosine", warmup_steps=50, end_lr_fraction=0.05
    )  # AdamW + warmup-cosine
    c.optim.total_steps = c.get_ref("steps")  # the cosine ends with SFT (follows sft.steps)
    c.log_every = 100  # progress-line interval when not on a TTY
    c.checkpoint_every = 500  # checkpoint interval in steps (the last step is always saved)
    c.eval = sft_eval_config()  # the base-model evaluation written to sft_eval.json
    c.require = sft_require_config()  # gates on the base model, checked before any RL
    c.select = sft_select_config()  # model selection on dev tasks (tg_jax.train.sft_select)
    # Selection's compliance bounds follow the gates' (overriding a gate moves both).
    c.select.unprompted_max = c.require.get_ref("max_unprompted_compliance")
    c.select.hinted_min = c.require.get_ref("min_hinted_compliance")
    c.extend = sft_extend_config()  # more steps for a run still low on dev at sft.steps
    c.retry_seeds = 0  # on a gate failure retry SFT with seed+1, data_seed+1, this many times
    # Where the base model comes from: train (SFT in the run, as above) | shipped (the base
    # `base` under tg_jax/bases, trained once, the same file on every machine; the gates apply
    # to its recorded figures; tg_jax.train.shipped_base).
    c.source = "train"
    c.base = ""  # the shipped base: a name under tg_jax/bases, or a directory
    c.update(overrides)
    return c


def sft_extend_config(**overrides: Any) -> ml_collections.ConfigDict:
    """SFT steps after `sft.steps` for a run that has not learnt the tasks by then (the
    fields: `tg_jax.train.sft_select.ExtendConfig`)."""
    return ExtendConfig.config_dict(**overrides)


def sft_select_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Model selection during SFT on tasks of the dev split (the fields:
    `tg_jax.train.sft_select.SelectConfig`)."""
    return SelectConfig.config_dict(**overrides)


def sft_require_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Gates on the base model's sft_eval.json, checked before RL (the fields:
    `tg_jax.train.sft_settings.RequireConfig`)."""
    return RequireConfig.config_dict(**overrides)


def sft_eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The base model's evaluation on dev tasks (the fields:
    `tg_jax.train.sft_settings.SftEvalConfig`)."""
    return SftEvalConfig.config_dict(**overrides)


def loop_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The RL loop: steps, rollout groups, sampling, evaluation, checkpoints, feedback quality
    (the fields: `tg_jax.train.loop_settings.LoopConfig`)."""
    return LoopConfig.config_dict(**overrides)


def tiny_loop_config(**overrides: Any) -> ml_collections.ConfigDict:
    """A loop that runs a few steps in seconds on CPU (tests)."""
    c = loop_config(
        steps=4, groups_per_step=2, rollouts_per_group=2, max_new_tokens=24, length_multiple=0,
        eval_every=2, eval_tasks=4, checkpoint_every=1, keep_checkpoints=2, log_every=1,
        use_tensorboard=False,
    )  # fmt: skip
    c.update(overrides)
    return c


def eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """Final held-out evaluation, arms and seeds, statistics and the non-inferiority margin
    (the fields: `tg_jax.evaluation.report_settings.EvalConfig`)."""
    return EvalConfig.config_dict(**overrides)


def pipeline_config(**overrides: Any) -> ml_collections.ConfigDict:
    """The main job (tg_jax.train.pipeline): its arms and their learning-rate selection (the
    fields: `tg_jax.train.loop_settings.PipelineConfig`)."""
    return PipelineConfig.config_dict(**overrides)


def tiny_eval_config(**overrides: Any) -> ml_collections.ConfigDict:
    """A held-out evaluation that runs in seconds on CPU (tests)."""
    c = eval_config(
        num_tasks=4, samples_per_task=1, max_new_tokens=24, train_seeds=(0,), n_boot=200,
        last_k=2,
    )  # fmt: skip
    c.update(overrides)
    return c
