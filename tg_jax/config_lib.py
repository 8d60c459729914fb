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

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import ml_collections

from tg_jax import config_schema
from tg_jax.data.task_settings import SweTasksConfig, TasksConfig
from tg_jax.envs.coding import CodingEnvConfig
from tg_jax.envs.swe.env import SweEnvConfig
from tg_jax.envs.transcripts import TranscriptConfig
from tg_jax.errors import ConfigError, UsageError
from tg_jax.evaluation.report_settings import EvalConfig
from tg_jax.mesh_settings import MeshConfig, SamplerMeshConfig
from tg_jax.models.config import ModelConfig
from tg_jax.rl.step_config import OptimConfig, RLConfig, StepConfig, TGConfig
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
    vocab_size=272,
    d_model=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    mlp_dim=384,
    rope_theta=10_000.0,
    tie_embeddings=True,
    max_seq_len=512,
)


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
        vocab_size=272,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        mlp_dim=64,
        max_seq_len=128,
    )


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
        steps=4,
        groups_per_step=2,
        rollouts_per_group=2,
        max_new_tokens=24,
        length_multiple=0,
        eval_every=2,
        eval_tasks=4,
        checkpoint_every=1,
        keep_checkpoints=2,
        log_every=1,
        use_tensorboard=False,
    )
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
        num_tasks=4,
        samples_per_task=1,
        max_new_tokens=24,
        train_seeds=(0,),
        n_boot=200,
        last_k=2,
    )
    c.update(overrides)
    return c


# Start-up checks of a run config: what `python -m tg_jax.main` refuses before any compute.

# The sections declared as dataclasses that a run config's start-up check reads back (unknown
# fields, bad values): each section's own checks are its dataclass's `__post_init__`.
CHECKED_SECTIONS = {
    "rl_loop": LoopConfig,
    "pipeline": PipelineConfig,
    "mesh": MeshConfig,
    "sampler_mesh": SamplerMeshConfig,
    "eval": EvalConfig,
    "sft": SftConfig,
}


@contextlib.contextmanager
def _invalid() -> Iterator[None]:
    """A ValueError of a check becomes a ConfigError (one `error: invalid config:` line)."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check(config: ml_collections.ConfigDict, workdir: str, stages: Iterable[str]) -> None:
    """What the config (and the registry it names) decides, before any device or data: a
    UsageError or ConfigError on the first problem, naming the field to change.

    Args:
      config: the run config (`python -m tg_jax.main`'s `--config`).
      workdir: the run's directory (a registered hypothesis's attempts are read beside it).
      stages: the stages `config.stage` may name.
    """
    if config.stage not in stages:
        raise UsageError(f"unknown stage {config.stage!r} (known: {', '.join(sorted(stages))})")
    if config.stage == "sft" and "model" in config and config.model.get("hf_checkpoint"):
        raise UsageError(
            "the sft stage trains the embedded default from scratch; a model.hf_checkpoint "
            "run starts RL from the checkpoint (--config.stage=pipeline)"
        )
    if "env" in config:
        with _invalid():
            _check_env(config)
    with _invalid():  # each section's own checks, then what the sections decide together
        for name, section in CHECKED_SECTIONS.items():
            if name in config:
                section.from_config(config[name])
        if "rl_loop" in config:
            _check_loop(config)
        if all(name in config for name in ("rl", "tg", "optim")):
            StepConfig.from_config(config)  # the train step's, now rather than after SFT
        if "sft" in config and "require" in config.sft:
            from tg_jax.train.sft_gates import check_require_config

            check_require_config(config)  # gates no base model can meet
        if config.stage == "pipeline" and "pipeline" in config:
            from tg_jax.train import tuning

            tuning.check_tune_config(config)  # learning-rate trials that cannot run
        if config.stage == "pipeline" and "eval" in config:
            from tg_jax.evaluation import registry

            registry.check(config.eval, workdir)  # a registered hypothesis: its attempts
    from tg_jax import faults

    try:  # a malformed fault plan fails here, not in a worker thread at its first use
        faults.validate()
    except ValueError as e:
        raise UsageError(str(e)) from e


def _check_env(config: ml_collections.ConfigDict) -> None:
    """The environment and its requirements (plug-ins loaded and checked), and the dev tasks
    a periodic evaluation or `tasks.dev_source` needs."""
    from tg_jax.data.task_data import check_dev_source, check_dev_tasks
    from tg_jax.envs import env_kind, requirement_names

    env_kind(config.env)
    requirement_names(config.env)
    if "rl_loop" in config and int(config.rl_loop.eval_every) > 0:
        check_dev_tasks(
            config,
            "the periodic evaluation (rl_loop.eval_every)",
            "; set rl_loop.eval_every=0 or give it one",
        )
    if "tasks" in config and config.tasks.get("dev_source"):
        check_dev_source(config)


def _check_loop(config: ml_collections.ConfigDict) -> None:
    """ValueError where the RL loop's settings cannot run: hint kinds, a wrong judge's rates,
    router replay on an engine without it, thinking controls (each arm's)."""
    from tg_jax.rl import hidden_thinking
    from tg_jax.sampling.agent_loop import router_replay
    from tg_jax.train import rl_rollouts

    rl_rollouts.feedback_rates(config.rl_loop.feedback)
    rl_rollouts.verdict_noise(config.rl_loop.feedback)
    for _, c in run_configs(config):  # a pipeline's arms may turn them on
        router_replay(c)  # vLLM records no routing to replay; nor does a turn in two parts
        hidden_thinking.check_config(c)


def run_configs(config: ml_collections.ConfigDict) -> list[tuple[str, Any]]:
    """(name, config) of what the run trains: the config, or each arm of a pipeline."""
    from tg_jax.train.arms import arm_config

    if config.stage == "pipeline" and "pipeline" in config:
        return [(f"arm {a!r}", arm_config(config, a)) for a in config.pipeline.arms]
    return [("the config", config)]


def check_on_devices(config: ml_collections.ConfigDict) -> None:
    """What needs the devices or the files the config names: the sampler's split, the epochs
    of generated tasks, the checkpoint directory or the shipped base, the fit on TPU chips."""
    if "sampler_mesh" in config:  # the devices now known: a split that cannot be built
        from tg_jax import sharding
        from tg_jax.sampling.rollout import RolloutConfig

        with _invalid():
            sharding.split_devices(config)
            RolloutConfig(max_rows=int(config.sampler_mesh.get("max_rows", 0)))
    if "rl_loop" in config and "tasks" in config and not config.tasks.get("train_source"):
        from tg_jax.data.task_data import check_epochs

        # generated tasks: their count is the config's (a task file's: once read)
        check_epochs(config.rl_loop, int(config.tasks.num_train))
    if "model" in config and config.model.get("hf_checkpoint") and config.stage != "data":
        check_model_dir(config)
    elif config.stage in ("pipeline", "sft") and "sft" in config:  # shipped bases: there, right
        from tg_jax.train import shipped_base

        if config.stage == "pipeline" and shipped_base.source(config) == "shipped":
            shipped_base.check(config)
        else:  # SFT trains the base: from sft.init's weights when set
            shipped_base.sft_init(config)
    check_fit(config)


def check_fit(config: ml_collections.ConfigDict) -> None:
    """On a TPU backend (and `rl_loop.check_fit`): the RL programs' memory against the chips'
    (`tg_jax.tpu.fit`): a `fit.FitError` (its first line, then the figures) if they do not
    fit; the figures logged if they do."""
    import jax

    lc = config.get("rl_loop") if config.stage == "pipeline" else None
    if lc is None or jax.default_backend() != "tpu" or not lc.get("check_fit", True):
        return
    from absl import logging

    from tg_jax.tpu import fit

    logging.warning("fit check:\n%s", "\n".join(fit.check(config)))


def check_model_dir(config: ml_collections.ConfigDict) -> None:
    """The checkpoint directory opens (its chat template serves a rollout; a
    `hf_dir.ModelDirError` if not), and the config asks nothing of the model it lacks:
    distilling, hiding or budgeting thinking needs a template with thinking."""
    from tg_jax.models import hf_dir

    ckpt = config.model.hf_checkpoint
    md = hf_dir.open_model_dir(ckpt, tool_format=config.model.get("tool_format", ""))
    if md.renderer.has_thinking:
        return
    none = f"the chat template of {ckpt} renders no thinking (it drops reasoning_content)"
    for what, c in run_configs(config):
        tg, lc = c.get("tg", {}), c.get("rl_loop", {})
        if tg.get("enabled") and tg.get("include_thinking"):
            raise ConfigError(
                f"tg.include_thinking is True in {what}, but {none}: there are no thinking "
                "tokens to distil; set tg.include_thinking=False"
            )
        if lc.get("hide_thinking"):
            raise ConfigError(
                f"rl_loop.hide_thinking is True in {what}, but {none}: there is no thinking to "
                "hide; set rl_loop.hide_thinking=False"
            )
        if lc.get("think_budget"):
            raise ConfigError(
                f"rl_loop.think_budget is set in {what}, but {none}: there is no thinking to "
                "budget; set rl_loop.think_budget=0"
            )
