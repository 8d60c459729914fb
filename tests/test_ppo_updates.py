"""PPO update phases (rl.num_updates epochs x rl.num_minibatches): the clip acts, the decoupled
objective matches numpy, one update is today's step, sharded equals single-device, a user's
run end to end."""

import dataclasses
import functools
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tg_jax import config_files, config_lib, sharding
from tg_jax.models import ModelConfig, Transformer, forward, init_params
from tg_jax.rl import train_state as tst
from tg_jax.rl import train_step as ts
from tg_jax.rl import updates
from tg_jax.rl.batch import build_batch
from tg_jax.rl.step_config import RLConfig, StepConfig
from tg_jax.testing import synthetic_trajectories
from tg_jax.tpu.distributed import cpu_devices_env

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _config(**overrides):
    """configs/tiny.py on one device, with `overrides`."""
    cfg = config_files.load_config_file(TINY)
    return config_files.apply_overrides(cfg, {"mesh.shape": (1, 1, 1, 1), **overrides})


@functools.cache
def _model_and_params():
    model = Transformer(ModelConfig.from_config(_config().model))
    return model, init_params(model, jax.random.key(0))


@functools.cache
def _forward():
    """The tiny model's forward, jitted once for the module (one compile a batch shape)."""
    return jax.jit(functools.partial(forward, _model_and_params()[0]))


def _own_logprobs(batch, params):
    logits = _forward()(params, batch.tokens_BxT, batch.positions_BxT, batch.segment_ids_BxT)
    logp = jax.nn.log_softmax(logits, -1)
    return np.take_along_axis(np.asarray(logp), batch.targets_BxT[..., None], -1)[..., 0]


def _batch(num=8, *, chunks=1, noise=0.0, compact=True, batch_multiple=1, seed=0):
    """Synthetic rollouts laid out in `chunks` chunks; behaviour log-probs = the initial
    params' own (a synchronous batch) plus `noise` (a stale one)."""
    trajs = synthetic_trajectories(np.random.default_rng(seed), num, 40, hint_len=5)
    batch = build_batch(
        trajs, max_len=64, teacher_max_len=64, requirement_names=("fence",),
        pad_to_multiple=16, micro_batches=chunks, compact=compact,
        batch_multiple=batch_multiple,
    )  # fmt: skip
    logp = _own_logprobs(batch, _model_and_params()[1])
    eps = np.random.default_rng(1).normal(0, noise, logp.shape) if noise else 0.0
    behaviour = np.where(batch.loss_mask_BxT, logp + eps, 0.0).astype(np.float32)
    return dataclasses.replace(batch, behaviour_logprobs_BxT=behaviour)


def _state(cfg, mesh):
    model, params = _model_and_params()
    rules = sharding.logical_rules(cfg.mesh)
    return tst.create_train_state(
        model, tst.make_optimizer(cfg.optim), mesh, rules, jax.random.key(1), params=params
    )


def _single_mesh():
    return sharding.make_mesh(config_lib.mesh_config((1, 1, 1, 1)), jax.devices()[:1])


def _run_steps(cfg, batches, mesh):
    model, _ = _model_and_params()
    state = _state(cfg, mesh)
    step = ts.make_train_step(cfg, model, mesh, sharding.logical_rules(cfg.mesh))
    out = []
    for batch in batches:
        state, metrics = step(state, batch)
        out.append(jax.device_get(metrics))
    return jax.device_get(state), out


def _tree_close(a, b, atol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0.0)


# (1) The clip acts after the first minibatch.


@pytest.mark.slow
def test_clip_fractions_nonzero_after_first_minibatch():
    cfg = _config(**{"rl.num_updates": 4, "rl.num_minibatches": 4, "rl.dual_clip": 3.0})
    typed = StepConfig.from_config(cfg)
    batch = _batch(8, chunks=typed.rl.num_chunks)
    model, _ = _model_and_params()
    mesh = _single_mesh()
    state = _state(cfg, mesh)
    optimizer = tst.make_optimizer(cfg.optim)
    adv_B, _, _ = ts.batch_advantages(batch, typed.rl)
    phase = jax.jit(
        functools.partial(ts.update_phase, model=model, config=typed, optimizer=optimizer)
    )
    with jax.set_mesh(mesh):
        # The step's key: the train step below shuffles the same minibatches.
        _, _, stacked = phase(state, batch, adv_B, None, jax.random.fold_in(state.rng, 0))
    stacked = jax.device_get(stacked)
    clip_U = stacked["clip_frac_low"] + stacked["clip_frac_high"]
    assert clip_U.shape == (16,)
    # The first update starts at the proximal params: ratio 1 up to float error, no clip.
    assert clip_U[0] == 0.0 and stacked["ratio_abs_dev"][0] < 1e-4
    assert stacked["approx_kl"][0] < 1e-6
    assert clip_U[1:].max() > 0 and stacked["ratio_abs_dev"][1:].max() > 1e-3
    assert stacked["update_skipped"].sum() == 0
    # The step reports the phase means, and its step counts one rollout batch.
    new_state, metrics = _run_steps(cfg, [batch], mesh)
    m = metrics[0]
    assert m["clip_frac_low"] + m["clip_frac_high"] > 0 and m["ratio_abs_dev"] > 0
    np.testing.assert_allclose(m["clip_frac_low"], stacked["clip_frac_low"].mean(), atol=1e-6)
    assert m["approx_kl"] > 0 and int(new_state.step) == 1
    assert int(tst.schedule_count(new_state.opt_state)) == 16  # one per minibatch update


# (2) The decoupled objective against numpy.


def _np_decoupled(logp, behaviour, prox, adv_B, mask, *, clip_low, clip_high, dual, cap):
    """Per-token PPO loss, its gradient in logp and the clip fractions (float64)."""
    logp, behaviour, prox = (np.asarray(x, np.float64) for x in (logp, behaviour, prox))
    adv = np.broadcast_to(np.asarray(adv_B, np.float64)[:, None], logp.shape)
    r = np.exp(logp - prox)
    unclipped, clipped = -adv * r, -adv * np.clip(r, 1 - clip_low, 1 + clip_high)
    loss = np.maximum(unclipped, clipped)
    grad = np.where(unclipped >= clipped, -adv * r, 0.0)  # d/dlogp of the active branch
    dual_on = (adv < 0) & (-adv * dual < loss)
    loss, grad = np.where(dual_on, -adv * dual, loss), np.where(dual_on, 0.0, grad)
    w = np.minimum(np.exp(prox - behaviour), cap)
    n = mask.sum()
    return {
        "pg_loss": (loss * w * mask).sum() / n,
        "grad": grad * w * mask / n,
        "clip_frac_low": (((adv < 0) & (r < 1 - clip_low)) * mask).sum() / n,
        "clip_frac_high": (((adv > 0) & (r > 1 + clip_high)) * mask).sum() / n,
        "dual_clip_frac": (dual_on * mask).sum() / n,
        "ratio_abs_dev": (np.abs(r - 1) * mask).sum() / n,
        "approx_kl": ((r - 1 - np.log(r)) * mask).sum() / n,
        "tis_weight_mean": (w * mask).sum() / n,
    }


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, 1.5])
def test_decoupled_ppo_matches_numpy_on_a_stale_batch(cap):
    rng = np.random.default_rng(0)
    B, T = 6, 12
    mask = rng.random((B, T)) < 0.7
    prox = -rng.uniform(0.1, 3.0, (B, T))
    behaviour = prox + rng.normal(0, 0.3, (B, T))  # stale: the sampler was another version
    logp = prox + rng.normal(0, 0.4, (B, T))  # after some updates: many tokens clipped
    logp[1, :4] = prox[1, :4] + 1.5  # A < 0 and ratio e^1.5 > 3: the dual clip
    mask[1, :4] = True
    adv = np.array([1.5, -2.0, 0.5, -0.7, 2.0, -1.2])
    kw = {"clip_low": 0.2, "clip_high": 0.28, "dual": 3.0}
    ref = _np_decoupled(logp, behaviour, prox, adv, mask, cap=np.inf if cap is None else cap, **kw)
    # The train step's policy term: decoupled (proximal given), uncapped without tis_cap.
    rl_cfg = RLConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, tis_cap=cap)
    share = ts.Shares(agg=jnp.ones(()), tokens=jnp.ones(()))
    batch = dataclasses.replace(
        _batch(8), loss_mask_BxT=mask, behaviour_logprobs_BxT=behaviour.astype(np.float32)
    )

    def term(x):
        return ts.policy_term(x, batch, jnp.asarray(adv, jnp.float32), rl_cfg, share,
                              jnp.asarray(prox, jnp.float32))  # fmt: skip

    (loss, pm), grad = jax.value_and_grad(term, has_aux=True)(jnp.asarray(logp, jnp.float32))
    np.testing.assert_allclose(loss, ref["pg_loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grad, ref["grad"], rtol=1e-4, atol=1e-6)
    for k in ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_abs_dev",
              "approx_kl", "tis_weight_mean"):  # fmt: skip
        np.testing.assert_allclose(getattr(pm, k), ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert ref["clip_frac_low"] > 0 and ref["clip_frac_high"] > 0 and ref["dual_clip_frac"] > 0
    assert abs(ref["tis_weight_mean"] - 1.0) > 1e-3  # stale: the weight is not 1


# (3) One update per batch is today's step.


def _todays_step(state, batch, *, model, config, optimizer):
    """The train step before update phases: one update on whole-batch normalisers."""
    adv_B, _, _ = ts.batch_advantages(batch, config.rl)
    norms = ts.normalizers(batch, config.tg)
    loss = functools.partial(
        ts.loss_fn, model=model, rl_cfg=config.rl, tg_cfg=config.tg, step=state.step,
        norms=norms,
    )  # fmt: skip
    grads, sums, _ = updates.accumulate_grads(
        jax.grad(loss, has_aux=True), state.params, batch, adv_B, config.rl.micro_batches
    )
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(sums["loss"]) & jnp.isfinite(grad_norm)
    deltas, new_opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, deltas)
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(finite, new, old))
    return keep(new_params, state.params), keep(new_opt_state, state.opt_state)


@pytest.mark.slow
@pytest.mark.parametrize("tis_cap", [0.0, 2.0])
def test_one_update_equals_todays_step(tis_cap):
    cfg = _config(**{"rl.num_updates": 1, "rl.num_minibatches": 1, "rl.tis_cap": tis_cap})
    typed = StepConfig.from_config(cfg)
    assert not typed.rl.decoupled
    batch = _batch(8, noise=0.1)
    model, _ = _model_and_params()
    mesh = _single_mesh()
    optimizer = tst.make_optimizer(cfg.optim)
    with jax.set_mesh(mesh):
        want = jax.device_get(
            jax.jit(
                functools.partial(_todays_step, model=model, config=typed, optimizer=optimizer)
            )(_state(cfg, mesh), batch)
        )
    state, _ = _run_steps(cfg, [batch], mesh)
    _tree_close(state.params, want[0], atol=0.0)
    _tree_close(state.opt_state, want[1], atol=0.0)
    if not tis_cap:
        return
    # The decoupled form with a single update on a synchronous batch is the same update: the
    # TIS weight of a synchronous batch is 1, so one case checks it (with the cap, whose code
    # the uncapped case skips; two more programs to compile a case).
    sync = _batch(8)
    adv_B, _, _ = ts.batch_advantages(sync, typed.rl)
    kw = {"model": model, "config": typed, "optimizer": optimizer}
    with jax.set_mesh(mesh):
        one = jax.jit(functools.partial(ts.single_update, **kw))(
            _state(cfg, mesh), sync, adv_B, ts.normalizers(sync, typed.tg), None
        )
        phase = jax.jit(functools.partial(ts.update_phase, **kw))(
            _state(cfg, mesh), sync, adv_B, None, jax.random.key(0)
        )
    _tree_close(jax.device_get(phase[0]), jax.device_get(one[0]), atol=1e-6)


# (4) Sharded equals single-device.


@pytest.mark.slow
@pytest.mark.parametrize(
    "compact, credit",
    [(True, "episode"), (False, "episode"), (True, "turn")],
    ids=["chunk_shuffle", "row_shuffle", "turn_credit"],
)
def test_sharded_update_phase_equals_single_device(compact, credit):
    # Adam's eps as in test_train_step: m / sqrt(v) of a gradient near 0 would turn float
    # noise of the reduction order into an lr-sized step.
    overrides = {
        "rl.num_updates": 2, "rl.num_minibatches": 2, "rl.dual_clip": 3.0, "optim.eps": 1e-6,
        "rl.requirement_credit": credit,
        "rl.reward_weights": ml_collections.ConfigDict({"task": 1.0, "fence": 0.5}),
    }  # fmt: skip
    mesh8 = sharding.make_mesh(config_lib.mesh_config((2, 2, 2, 1)))
    cfg8 = _config(**overrides, **{"mesh.shape": (2, 2, 2, 1)})
    divisor = sharding.batch_divisor(mesh8, sharding.logical_rules(cfg8.mesh))
    typed = StepConfig.from_config(cfg8)
    typed.rl.check_rows(16, divisor)
    batch = _batch(16, chunks=typed.rl.num_chunks, compact=compact, batch_multiple=divisor)
    assert updates.rows_aligned(batch) == (not compact)
    sharded = _run_steps(cfg8, [batch, batch], mesh8)
    single = _run_steps(_config(**overrides), [batch, batch], _single_mesh())
    for ma, mb in zip(sharded[1], single[1], strict=True):
        assert ma.keys() == mb.keys()
        for k in ma:
            np.testing.assert_allclose(ma[k], mb[k], atol=1e-5, rtol=1e-5, err_msg=k)
    _tree_close(sharded[0].params, single[0].params, atol=1e-5)
    assert single[1][1]["tg_loss"] > 0 and single[1][1]["update_skipped"] == 0
    if credit == "turn":  # per-token advantages: the turn term is not the episode's
        typed1 = StepConfig.from_config(_config(**overrides))
        adv_BxT, _, _ = ts.batch_advantages(batch, typed1.rl)
        episode = dataclasses.replace(typed1.rl, requirement_credit="episode")
        adv_B, _, _ = ts.batch_advantages(batch, episode)
        assert adv_BxT.ndim == 2 and adv_B.ndim == 1
        mask = np.asarray(batch.loss_mask_BxT)
        assert np.abs(np.asarray(adv_BxT) - np.asarray(adv_B)[:, None])[mask].max() > 1e-3


def test_minibatch_rows_checked_at_config_time():
    rl = RLConfig(num_minibatches=2, micro_batches=2)
    rl.check_rows(16, 4)
    with pytest.raises(ValueError, match="rl.num_minibatches=2.*multiple of 16"):
        rl.check_rows(8, 4)
    RLConfig(num_minibatches=1).check_rows(3, 8)  # one minibatch: padded, as before
    with pytest.raises(ValueError, match="num_updates must be >= 1"):
        RLConfig(num_updates=0)


# (5) A user's run.


@pytest.mark.e2e
def test_main_runs_ppo_epochs_end_to_end(tmp_path):
    env = {**cpu_devices_env(1), "JAX_PLATFORMS": "cpu"}  # a laptop: one CPU device
    workdir = tmp_path / "w"
    steps = 2  # the second one's rollouts come from params the first moved
    result = subprocess.run(
        [sys.executable, "-m", "tg_jax.main", f"--config={TINY}", f"--workdir={workdir}",
         "--config.stage=pipeline", "--config.rl.num_updates=2",
         "--config.rl.num_minibatches=2", f"--config.rl_loop.steps={steps}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert (workdir / "report" / "report.md").exists()
    for arm in ("grpo", "tg"):
        lines = (workdir / "runs" / f"{arm}_seed0" / "metrics.jsonl").read_text().splitlines()
        train = [r for r in map(json.loads, lines) if r["stage"] == "train"]
        assert [r["step"] for r in train] == list(range(1, steps + 1))
        assert all(np.isfinite(r["ratio_abs_dev"]) and r["update_skipped"] == 0 for r in train)
    # TG moves the params in the first update: the second one sees ratios away from 1.
    assert max(r["ratio_abs_dev"] for r in train) > 0 and max(r["approx_kl"] for r in train) > 0
