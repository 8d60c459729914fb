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
from tg_jax.train.sft_settings import (
    ExtendConfig,
    RequireConfig,
    SelectConfig,
    SftConfig,
    SftEvalConfig,
)


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
    """SFT of the base model (the fields: `tg_jax.train.sft_settings.SftConfig`), with two
    links: the optimizer's cosine ends with SFT (`optim.total_steps` follows `steps`), and
    selection's compliance bounds follow the gates' (overriding a gate moves both)."""
    c = SftConfig.config_dict(steps=steps)
    c.optim.total_steps = c.get_ref("steps")
    c.select.unprompted_max = c.require.get_ref("max_unprompted_compliance")
    c.select.hinted_min = c.require.get_ref("min_hinted_compliance")
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
