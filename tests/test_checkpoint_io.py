"""HF safetensors import/export: logits equal transformers', sharded reads, exact round trips."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.hf_checkpoints import hf_logits, make_hf_model
from tg_jax import config_lib, sharding
from tg_jax.models import ModelConfig, Transformer, forward
from tg_jax.models import checkpoint_io as cio
from tg_jax.models.hf_io import model_config_from_hf

DENSE = dict(
    vocab_size=96, d_model=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    mlp_dim=80, rope_theta=10_000.0, max_seq_len=64,
)  # fmt: skip
MOE = dict(DENSE, mlp_dim=0, num_experts=8, experts_per_token=3, moe_mlp_dim=24)
TOKENS = np.random.default_rng(0).integers(0, 96, size=(4, 13))


def _saved(tmp_path_factory, name, cfg, **save_kw):
    model = make_hf_model(cfg, seed=len(name))
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path, **save_kw)
    return model, path


@pytest.fixture(scope="module")
def dense_tied(tmp_path_factory):
    return _saved(tmp_path_factory, "dense_tied", ModelConfig(**DENSE, tie_embeddings=True))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    cfg = ModelConfig(**MOE, norm_topk_prob=True, router_aux_loss_coef=0.01)
    return _saved(tmp_path_factory, "moe", cfg)


def _logits(cfg, params, mesh=None, rules=None):
    fn = jax.jit(lambda p, t: forward(Transformer(cfg), p, t))
    tokens = jnp.asarray(TOKENS, jnp.int32)
    if mesh is None:
        return np.asarray(fn(params, tokens))
    with sharding.activation_sharding(mesh, rules):
        return np.asarray(fn(params, tokens))


def _assert_matches_hf(logits, hf_model):
    ref = hf_logits(hf_model, TOKENS)
    assert np.abs(ref).max() > 0.5  # not a comparison of near-zero logits
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)


def test_dense_untied_import_matches_transformers(tmp_path):
    hf_model = make_hf_model(ModelConfig(**DENSE, tie_embeddings=False), seed=3)
    hf_model.save_pretrained(tmp_path)
    params, cfg = cio.load_hf_checkpoint(str(tmp_path))
    assert not cfg.tie_embeddings and "lm_head" in params
    _assert_matches_hf(_logits(cfg, params), hf_model)


def test_dense_tied_import_matches_transformers(dense_tied):
    hf_model, path = dense_tied
    params, cfg = cio.load_hf_checkpoint(path)
    assert cfg.tie_embeddings and "lm_head" not in params
    _assert_matches_hf(_logits(cfg, params), hf_model)


def test_moe_import_matches_transformers(moe):
    hf_model, path = moe
    params, cfg = cio.load_hf_checkpoint(path)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_mlp_dim) == (8, 3, 24)
    assert cfg.norm_topk_prob and cfg.router_aux_loss_coef == 0.01
    assert params["layers"]["mlp"]["gate_proj"].shape == (2, 8, 48, 24)
    assert params["layers"]["mlp"]["router"].shape == (2, 48, 8)
    _assert_matches_hf(_logits(cfg, params), hf_model)


@pytest.mark.slow
@pytest.mark.parametrize(
    "which,mesh_shape", [("dense", (2, 2, 2, 1)), ("moe", (2, 1, 2, 2))], ids=["dense", "moe"]
)
def test_sharded_import_reads_slices_and_matches(which, mesh_shape, dense_tied, moe, monkeypatch):
    hf_model, path = dense_tied if which == "dense" else moe
    reads = []
    original = cio.HFCheckpoint.read

    def spy(self, name, index=None):
        out = original(self, name, index)
        reads.append((name, out.size))
        return out

    monkeypatch.setattr(cio.HFCheckpoint, "read", spy)
    mesh_cfg = config_lib.mesh_config(mesh_shape)
    mesh, rules = sharding.make_mesh(mesh_cfg), sharding.logical_rules(mesh_cfg)
    params, cfg = cio.load_hf_checkpoint(path, mesh=mesh, rules=rules)
    # Each device read only its slice: the [V, D] embedding is split 2 ways (tensor) x fsdp.
    embed_reads = [n for name, n in reads if name == "model.embed_tokens.weight"]
    assert max(embed_reads) == 96 * 48 // (mesh.shape["tensor"] * mesh.shape["fsdp"])
    if which == "moe":
        spec = params["layers"]["mlp"]["gate_proj"].sharding.spec
        assert spec == jax.sharding.PartitionSpec(None, "expert", "fsdp", "tensor")
        assert len(params["layers"]["mlp"]["gate_proj"].addressable_shards[0].data.shape) == 4
    monkeypatch.undo()
    ref_params, _ = cio.load_hf_checkpoint(path)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, params), ref_params)
    _assert_matches_hf(_logits(cfg, params, mesh, rules), hf_model)


def test_hf_sharded_index_import(tmp_path):
    hf_model = make_hf_model(ModelConfig(**MOE, norm_topk_prob=False), seed=5)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.exists(tmp_path / cio.INDEX_FILE)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    params, cfg = cio.load_hf_checkpoint(str(tmp_path))
    assert not cfg.norm_topk_prob
    _assert_matches_hf(_logits(cfg, params), hf_model)


def test_fused_expert_tensors_import(moe, tmp_path):
    """transformers 5 keeps experts fused in memory ([E, 2F, D] / [E, D, F]): accept that too."""
    hf_model, path = moe
    state = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / cio.SINGLE_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    fused, _ = cio.load_hf_checkpoint(str(tmp_path))
    per_expert, _ = cio.load_hf_checkpoint(path)
    jax.tree.map(np.testing.assert_array_equal, fused, per_expert)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_export_round_trip_is_exact_and_transformers_loads_it(which, dense_tied, moe, tmp_path):
    import transformers

    hf_model, path = dense_tied if which == "dense" else moe
    mesh_cfg = config_lib.mesh_config((2, 1, 2, 2))
    mesh, rules = sharding.make_mesh(mesh_cfg), sharding.logical_rules(mesh_cfg)
    params, cfg = cio.load_hf_checkpoint(path, mesh=mesh, rules=rules)
    out = str(tmp_path / "export")
    files = cio.save_hf_checkpoint(
        out, params, cfg, max_shard_bytes=60_000, base_hf_config={"eos_token_id": 7}
    )
    assert cio.INDEX_FILE in files and len(files) > 3
    with open(os.path.join(out, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_config["eos_token_id"] == 7 and model_config_from_hf(hf_config) == cfg
    back, cfg_back = cio.load_hf_checkpoint(out)
    assert cfg_back == cfg
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, params))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="float32").eval()
    np.testing.assert_allclose(
        hf_logits(reloaded, TOKENS), hf_logits(hf_model, TOKENS), atol=1e-5, rtol=0
    )


def test_export_bf16_and_single_file(dense_tied, tmp_path):
    _, path = dense_tied
    params, cfg = cio.load_hf_checkpoint(path)
    files = cio.save_hf_checkpoint(str(tmp_path), params, cfg, dtype="bfloat16")
    assert files == [cio.SINGLE_FILE, "config.json"]
    back, _ = cio.load_hf_checkpoint(str(tmp_path))
    want = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(np.float32)), params)
    jax.tree.map(np.testing.assert_array_equal, back, want)


def test_mismatches_fail_clearly(dense_tied):
    _, path = dense_tied
    wrong = ModelConfig(**dict(DENSE, num_layers=3), tie_embeddings=True)
    with pytest.raises(ValueError, match=r"missing \['model.layers.2"):
        cio.load_hf_checkpoint(path, wrong)
    wrong = ModelConfig(**dict(DENSE, mlp_dim=64), tie_embeddings=True)
    with pytest.raises(ValueError, match="wrong shapes"):
        cio.load_hf_checkpoint(path, wrong)
    hf = {"vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(NotImplementedError, match="mlp_only_layers"):
        model_config_from_hf(dict(hf, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]))
    with pytest.raises(NotImplementedError, match="rope_scaling"):
        model_config_from_hf(dict(hf, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
