"""The synthetic demo workdir and reading results back (tables, curves, plots)."""

import os

import matplotlib
import numpy as np
import pytest

from tg_jax.metrics import read_metrics
from tg_jax.notebook import demo_workdir, results_view
from tg_jax.notebook.base_policy import load_base_policy

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo")
    return demo_workdir.make_demo_workdir(path, steps=8, eval_every=4, num_tasks=6, n_boot=50)


def test_demo_workdir_layout(workdir):
    assert results_view.find_results_file(workdir) == os.path.join(
        workdir, "report", "results.json"
    )
    assert os.path.exists(os.path.join(workdir, "report", "report.md"))
    runs = results_view.load_run_metrics(workdir)
    assert sorted(runs) == [f"runs/{a}_seed{s}" for a in ("grpo", "tg") for s in (0, 1)]
    train = [r for r in runs["runs/tg_seed0"] if r["stage"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))
    raw = read_metrics(os.path.join(workdir, "runs", "tg_seed0"), stage="eval")
    assert [r["step"] for r in raw] == [4, 8]


def test_find_results_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no results.json"):
        results_view.find_results_file(tmp_path)


def test_curves_and_tables_agree_with_results(workdir):
    results = results_view.load_results(workdir)
    runs = results_view.load_run_metrics(workdir)
    curves = results_view.arm_curves(results, "compliance", "train")
    assert set(curves) == {"grpo", "tg"} and curves["tg"]["n"] == 2
    per_seed = [results_view.metric_curve(runs[f"runs/tg_seed{s}"], "rollout/compliance")
                for s in (0, 1)]  # fmt: skip
    np.testing.assert_array_equal(curves["tg"]["steps"], per_seed[0][0])
    np.testing.assert_allclose(curves["tg"]["mean"], (per_seed[0][1] + per_seed[1][1]) / 2)
    held = results_view.arm_curves(results, "task_success", "eval")
    np.testing.assert_array_equal(held["grpo"]["steps"], [4, 8])

    rows = {r["arm"]: r for r in results_view.heldout_rows(results, "plain")}
    boot = results["arms"]["tg"]["heldout"]["plain"]["bootstrap"]["compliance"]
    assert (rows["tg"]["compliance"], rows["tg"]["compliance_low"]) == (boot["mean"], boot["low"])
    assert rows["tg"]["tasks"] == 6 and rows["tg"]["seeds"] == 2
    line = results_view.noninferiority_line(results)
    assert (
        line.startswith("non-inferiority of tg vs grpo")
        and results["noninferiority"]["verdict"].upper() in line
    )
    train = {r["arm"]: r for r in results_view.train_rows(results)}
    assert (
        train["grpo"]["task_success"]
        == results["arms"]["grpo"]["train_last_k"]["task_success"]["mean"]
    )


def test_plots(workdir):
    import matplotlib.pyplot as plt

    results = results_view.load_results(workdir)
    fig = results_view.plot_arm_curves(results)
    assert len(fig.axes) == 4 and all(ax.has_data() for ax in fig.axes)
    fig2 = results_view.plot_heldout(results)
    assert len(fig2.axes) == 2
    ax = results_view.plot_run_metric(results_view.load_run_metrics(workdir), "tg_kl")
    assert len(ax.lines) == 4
    plt.close("all")


@pytest.mark.slow
def test_load_base_policy_without_checkpoint(tmp_path):
    from tg_jax import config_files

    config = config_files.load_config_file("configs/tiny.py")
    policy = load_base_policy(config, None, seed=1)
    assert policy.num_params > 0 and "random init" in policy.source
    with pytest.raises(FileNotFoundError, match="no finished SFT checkpoint"):
        load_base_policy(config, str(tmp_path))
