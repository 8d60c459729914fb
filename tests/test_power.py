"""Seeds for a non-inferiority test from a pilot's variance (`tg_jax.evaluation.power`)."""

from statistics import NormalDist

import numpy as np
import pytest
import scipy.stats

from tg_jax.evaluation import power
from tg_jax.evaluation.heldout import HELDOUT_FILE, save_records
from tg_jax.sampling.episode import EpisodeRecord


def test_components_of_a_small_table_by_hand():
    d = np.array([[0.0, 0.2, 0.4], [0.2, 0.4, 0.9]])
    # d.. = 0.35; row means 0.2, 0.5; column means 0.1, 0.3, 0.65.
    # MS_seed = 3 * (0.15^2 + 0.15^2) / 1 = 0.135
    # MS_item = 2 * (0.25^2 + 0.05^2 + 0.3^2) / 2 = 0.155
    # residuals d - row - col + d.. = [[.05, .05, -.1], [-.05, -.05, .1]]: MS_res = 0.03 / 2
    c = power.components(d)
    assert c.mean == pytest.approx(0.35)
    assert c.var_resid == pytest.approx(0.015)
    assert c.var_seed == pytest.approx((0.135 - 0.015) / 3)
    assert c.var_item == pytest.approx((0.155 - 0.015) / 2)
    assert c.se(4, 10) == pytest.approx(np.sqrt(c.var_seed / 4 + c.var_item / 10 + 0.015 / 40))


def test_components_recover_a_simulated_table():
    rng = np.random.default_rng(0)
    s, k = 300, 300
    d = (0.02 + rng.normal(0, 0.1, (s, 1)) + rng.normal(0, np.sqrt(0.02), (1, k))
         + rng.normal(0, np.sqrt(0.05), (s, k)))  # fmt: skip
    c = power.components(d)
    assert c.var_seed == pytest.approx(0.01, rel=0.2)
    assert c.var_item == pytest.approx(0.02, rel=0.2)
    assert c.var_resid == pytest.approx(0.05, rel=0.05)


def test_power_and_the_seeds_needed_by_hand():
    # Seed variance only: the verdict's interval is the t-interval over seeds, df = S - 1,
    # se = sqrt(0.004 / S); power(S) = F_t,S-1(0.05 / se - t_0.975,S-1).
    comp = power.Components(0.0, var_seed=0.004, var_item=0.0, var_resid=0.0, seeds=3, clusters=50)
    by_hand = {}
    for s in range(3, 20):
        q = scipy.stats.t.ppf(0.975, s - 1)
        by_hand[s] = scipy.stats.t.cdf(0.05 / np.sqrt(0.004 / s) - q, s - 1)
    for s in (3, 5, 9):
        assert power.power(comp, s, margin=0.05, level=0.95, delta=0.0) == pytest.approx(by_hand[s])
    # The z quantile of a normal test would say 13 seeds ((z_0.975 + z_0.8)^2 * 0.004 / 0.05^2
    # = 12.56); Student's t asks for more at these small df.
    need = min(s for s, p in by_hand.items() if p >= 0.8)
    assert need == 15
    assert power.seeds_needed(comp, margin=0.05, level=0.95, delta=0.0, target=0.8) == need
    # At 3 seeds the t quantile (df 2: 4.30) leaves far less power than z (1.96) would say.
    z = NormalDist().inv_cdf(0.975)
    normal_3 = NormalDist().cdf(0.05 / np.sqrt(0.004 / 3) - z)
    assert power.power(comp, 3, margin=0.05, level=0.95, delta=0.0) < normal_3 - 0.2
    # An item term that alone exceeds the margin's room: no number of seeds suffices.
    items = power.Components(0.0, 0.0, var_item=0.05, var_resid=0.0, seeds=3, clusters=20)
    assert power.seeds_needed(items, margin=0.05, level=0.95, delta=0.0, target=0.8) is None
    need = power.clusters_needed(items, margin=0.05, level=0.95, delta=0.0, target=0.8)
    assert need == int(np.ceil(0.05 * ((z + NormalDist().inv_cdf(0.8)) / 0.05) ** 2))
    assert "about 157 clusters would be needed" in power.report(
        items, margin=0.05, level=0.95, delta=0.0, target=0.8
    )


def _pilot(workdir, seeds, rng):
    for arm, shift in (("tg", 0.0), ("grpo", 0.1)):
        for s in seeds:
            run = workdir / "runs" / f"{arm}_seed{s}"
            run.mkdir(parents=True)
            recs = [
                EpisodeRecord(
                    f"t{i}",
                    "plain",
                    0,
                    bool(rng.random() < 0.3 + shift),
                    {"r": True},
                    {},
                    1,
                    cluster_id=f"c{i // 2}",
                )  # fmt: skip
                for i in range(20)
            ]
            save_records(run / HELDOUT_FILE, recs)


def test_the_command_on_a_pilot_workdir(tmp_path, capsys):
    _pilot(tmp_path, (0, 1, 2), np.random.default_rng(1))
    assert power.main([f"--workdir={tmp_path}", "--margin=0.05"]) == 0
    out = capsys.readouterr().out
    assert "pilot: 3 seeds x 10 clusters" in out and "3 seeds: se" in out
    table = power.pilot_table(str(tmp_path), "tg", "grpo", "task_success")
    assert table.shape == (3, 10)
    one = tmp_path / "one"
    _pilot(one, (0,), np.random.default_rng(2))
    assert power.main([f"--workdir={one}"]) == 2
    assert "needs >= 2 training seeds" in capsys.readouterr().out
