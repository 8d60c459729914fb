"""Every config file loads; overrides of unknown keys or wrong types fail clearly."""

import dataclasses
import glob
import os

import pytest

from tg_jax import config_files, config_lib, config_schema
from tg_jax.data.task_settings import SweTasksConfig, TasksConfig
from tg_jax.envs.coding import CodingEnvConfig
from tg_jax.envs.swe.env import SweEnvConfig
from tg_jax.envs.transcripts import TranscriptConfig
from tg_jax.evaluation.report_settings import EvalConfig
from tg_jax.mesh_settings import MeshConfig, SamplerMeshConfig
from tg_jax.models import ModelConfig
from tg_jax.rl import step_config
from tg_jax.rl.step_config import OptimConfig, StepConfig, TGConfig
from tg_jax.train.loop_settings import FeedbackConfig, LoopConfig, PipelineConfig, TuneConfig
from tg_jax.train.sft_select import ExtendConfig, SelectConfig
from tg_jax.train.sft_settings import RequireConfig, SftConfig, SftEvalConfig

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "configs")
CONFIG_FILES = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.py")))


def test_there_are_configs():
    assert len(CONFIG_FILES) >= 2


@pytest.mark.parametrize("path", CONFIG_FILES, ids=os.path.basename)
def test_config_loads_and_model_builds(path):
    cfg = config_files.load_config_file(path)
    assert cfg.is_locked
    if cfg.model.d_model is None:  # architecture from model.hf_checkpoint's config.json
        with pytest.raises(ValueError, match="hf_checkpoint"):
            ModelConfig.from_config(cfg.model)
    else:
        ModelConfig.from_config(cfg.model)  # validates the architecture fields
    with open(path) as f:
        source = f.read()
    assert "python -m tg_jax.main" in source or "launch/" in source  # docstring has the command
    assert "stage" in cfg
    StepConfig.from_config(cfg)  # the train step's typed sections validate


def test_overrides_unknown_key_and_wrong_type():
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    new = config_files.apply_overrides(cfg, {"model.num_layers": 3})
    assert new.model.num_layers == 3 and cfg.model.num_layers == 2  # the original is untouched
    with pytest.raises(KeyError, match="num_layerz"):
        config_files.apply_overrides(cfg, {"model.num_layerz": 3})
    with pytest.raises(KeyError, match="modell"):
        config_files.apply_overrides(cfg, {"modell.num_layers": 3})
    with pytest.raises(TypeError, match="model.num_layers"):
        config_files.apply_overrides(cfg, {"model.num_layers": "three"})


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="nope.py"):
        config_files.load_config_file("configs/nope.py")


def test_step_config_typed_once():
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "default.py"))
    typed = StepConfig.from_config(cfg)
    assert StepConfig.from_config(typed) is typed  # typed configs pass through
    assert typed.rl.tis_cap is None and typed.rl.dual_clip is None  # 0 = off becomes None
    assert typed.rl.norm_length is None and typed.tg.top_k is None
    assert typed.rl.reward_weights == (("task", 1.0), ("tool_json", 0.5))
    assert typed.tg.kind == "forward" and typed.tg.normalize == "token_sum"
    assert typed.tg.norm_length == 50.0 and typed.optim.lr == 3e-4
    assert isinstance(typed.tg.lambda_tg, float) and typed.tg.lambda_tg == 0.05
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.rl.kl_coef = 1.0


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("rl.dual_clip", 0.5, "rl.dual_clip must be > 1"),
        ("rl.agg_mode", "sum", "rl.agg_mode must be one of"),
        ("rl.kl_estimator", "k4", "rl.kl_estimator"),
        ("rl.micro_batches", 0, "rl.micro_batches"),
        ("rl.temperature", 0.0, "rl.temperature"),
        ("tg.kind", "kl", "tg.kind"),
        ("tg.gate", "some_turns", "tg.gate"),
        ("tg.chunk_size", 0, "tg.chunk_size"),
        ("tg.normalize", "seq_mean", "tg.normalize must be one of"),
        ("tg.norm_length", 0.0, "tg.norm_length"),
        ("tg.schedule.kind", "step", "tg.schedule.kind"),
        ("optim.schedule", "linear", "optim.schedule"),
        ("optim.b2", 1.0, "optim.b2"),
    ],
)
def test_step_config_rejects_bad_values(key, value, match):
    cfg = config_files.load_config_file(os.path.join(CONFIG_DIR, "tiny.py"))
    with pytest.raises(ValueError, match=match):
        StepConfig.from_config(config_files.apply_overrides(cfg, {key: value}))


def test_step_config_cross_field_checks():
    with pytest.raises(ValueError, match="beta"):
        TGConfig(kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match="top_k"):
        TGConfig(estimator="sampled", top_k=4)
    with pytest.raises(ValueError, match="unknown fields"):
        OptimConfig.from_config({**config_lib.optim_config().to_dict(), "momentum": 0.9})


SECTIONS = [  # (the ConfigDict builder, its dataclass, the dataclass's instance of the defaults)
    (config_lib.rl_config, step_config.RLConfig, step_config.RLConfig()),
    (config_lib.tg_config, step_config.TGConfig, step_config.TGConfig()),
    (lambda: config_lib.tg_config().schedule, step_config.LambdaSchedule,
     step_config.LambdaSchedule()),
    (config_lib.optim_config, step_config.OptimConfig, step_config.OptimConfig()),
    (config_lib.sft_select_config, SelectConfig, SelectConfig()),
    (config_lib.sft_extend_config, ExtendConfig, ExtendConfig()),
    (config_lib.model_config, ModelConfig, config_lib.CPU_MODEL),
    (config_lib.env_config, CodingEnvConfig, CodingEnvConfig()),
    (config_lib.swe_env_config, SweEnvConfig, SweEnvConfig()),
    (config_lib.transcripts_config, TranscriptConfig, TranscriptConfig()),
    (config_lib.tasks_config, TasksConfig, TasksConfig()),
    (config_lib.swe_tasks_config, SweTasksConfig, SweTasksConfig()),
    (config_lib.sft_config, SftConfig, SftConfig()),
    (config_lib.sft_require_config, RequireConfig, RequireConfig()),
    (config_lib.sft_eval_config, SftEvalConfig, SftEvalConfig()),
    (config_lib.eval_config, EvalConfig, EvalConfig()),
    (config_lib.loop_config, LoopConfig, LoopConfig()),
    (lambda: config_lib.loop_config().feedback, FeedbackConfig, FeedbackConfig()),
    (config_lib.pipeline_config, PipelineConfig, PipelineConfig()),
    (lambda: config_lib.pipeline_config().tune, TuneConfig, TuneConfig()),
    (config_lib.mesh_config, MeshConfig, MeshConfig()),
    (config_lib.sampler_mesh_config, SamplerMeshConfig, SamplerMeshConfig()),
]  # fmt: skip


@pytest.mark.parametrize(("build", "cls", "default"), SECTIONS)
def test_each_section_is_its_dataclass(build, cls, default):
    """Every config section with a dataclass holds exactly the dataclass's fields (and the keys
    it declares as read elsewhere) and reads back into the dataclass's defaults; a changed
    value round-trips (an `off` field through its ConfigDict value, pairs through a dict)."""
    cfg = build()
    fields = sorted(f.name for f in dataclasses.fields(cls))
    assert sorted(k for k in cfg.keys() if k not in cls.ignored) == fields
    assert cls.from_config(cfg) == default
    for f in dataclasses.fields(cls):  # ConfigDicts hold plain values, never None
        assert cfg[f.name] is not None, f.name


def test_off_and_pairs_fields_round_trip():
    cfg = config_lib.rl_config(tis_cap=2.0)
    cfg.reward_weights = {"task": 1.0, "fence": 0.5}
    rl = step_config.RLConfig.from_config(cfg)
    assert rl.tis_cap == 2.0 and rl.dual_clip is None and rl.norm_length is None
    assert dict(rl.reward_weights) == {"task": 1.0, "fence": 0.5}
    assert config_lib.rl_config().tis_cap == 0.0  # None is 0.0 (a float field) on the line
    assert step_config.OptimConfig.from_config(config_lib.optim_config(grad_clip_norm=0.0)) == (
        step_config.OptimConfig(grad_clip_norm=None)
    )
    back = config_schema.config_dict(rl)
    assert step_config.RLConfig.from_config(back) == rl
    with pytest.raises(ValueError, match=r"rl\.clip_low: could not convert"):
        step_config.RLConfig.from_config({"clip_low": "wide"})


def test_loop_pipeline_and_mesh_sections_check_their_values():
    """A bad value of the rl_loop, pipeline and mesh sections is an error naming the field."""
    for section, cls, bad, match in (
        (config_lib.loop_config(engine_decode_steps=0), LoopConfig, None, "engine_decode_steps"),
        (config_lib.loop_config(engine_min_bucket=-1), LoopConfig, None, "engine_min_bucket"),
        (config_lib.loop_config(rollout_engine="sglang"), LoopConfig, None, "rollout_engine"),
        (config_lib.loop_config(), LoopConfig, ("feedback.wrong", 1.5), "feedback.wrong"),
        (config_lib.loop_config(), LoopConfig, ("speed", 2), "unknown fields"),
        (config_lib.pipeline_config(arms=("tg", "tg")), PipelineConfig, None, "distinct"),
        (config_lib.mesh_config(shape=(-1, -1, 1, 1)), MeshConfig, None, "at most one -1"),
        (config_lib.sampler_mesh_config(shape=(2,)), SamplerMeshConfig, None, "differ"),
        (config_lib.sampler_mesh_config(), SamplerMeshConfig, ("max_rows", -1), "max_rows"),
    ):
        cfg = section.to_dict()
        if bad is not None:
            *parents, key = bad[0].split(".")
            node = cfg
            for p in parents:
                node = node[p]
            node[key] = bad[1]
        with pytest.raises(ValueError, match=match):
            cls.from_config(cfg)
