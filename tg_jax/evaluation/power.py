"""How many training seeds a non-inferiority test needs: power from a pilot's variance.

    python -m tg_jax.evaluation.power --workdir=PILOT [--candidate=tg --baseline=grpo]
        [--metric=task_success --margin=0.05 --power=0.8 --level=0.95 --delta=0]

The pilot is a finished run of both arms (any number of seeds >= 2, e.g. the 3-seed demo);
its held-out episodes (`runs/<arm>_seed<k>/heldout.jsonl`) give the paired differences
y[s, c] = candidate - baseline of training seed s on cluster of tasks c
(`stats.cluster_table`: related tasks are one unit, as in the verdict). Their variance splits,
by the method of moments of a two-way random-effects table without replication
(`stats.mean_squares`), into

    y[s, c] = mu + b_s + i_c + e_sc
    var_b = (MS_seed - MS_res) / C,  var_i = (MS_cluster - MS_res) / S,  var_e = MS_res

(negative estimates set to 0). With S seeds the verdict's mean squares are expected to be
E[MS_seed] = C var_b + var_e and E[MS_cluster] = S var_i + var_e, and the verdict's own
interval (`stats.MeanSquares.half_width`, the one every verdict uses) gives its half width h
and degrees of freedom df at `level`. With q = t_{df}(1 - alpha), alpha = (1 - level) / 2, and
se_h = h / q the standard error the interval will use, the one-sided test passes with
probability about

    power(S) = F_{t, df}((delta + margin) / se_h - q)

for a true difference `delta` (default 0: the arms equal): Student's t, not the normal, so
3 seeds (df = 2) are priced as the wide interval they give. The command prints the
components, the power for 3..max_seeds seeds and the fewest seeds (at least
`stats.MIN_SEEDS`) reaching the target; when the item term alone forbids it, it says how
many clusters would be needed. A pre-registration states this number (`eval.train_seeds`).
The estimate is as good as the pilot: with 2-3 pilot seeds var_b is rough, so read the
table, not one number.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import re
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from tg_jax.evaluation import stats
from tg_jax.evaluation.heldout import HELDOUT_FILE, load_records

_RUN = re.compile(r"^(?P<arm>.+)_seed(?P<seed>\d+)$")


@dataclasses.dataclass(frozen=True)
class Components:
    """Variance components of the paired difference (module docstring)."""

    mean: float  # d.., the pilot's mean difference
    var_seed: float  # var_b
    var_item: float  # var_i (clusters)
    var_resid: float  # var_e
    seeds: int  # S of the pilot
    clusters: int  # C

    def se(self, seeds: int, clusters: int | None = None) -> float:
        c = self.clusters if clusters is None else clusters
        return float(
            np.sqrt(self.var_seed / seeds + self.var_item / c + self.var_resid / (seeds * c))
        )


def components(d_SxC: np.ndarray) -> Components:
    """Method-of-moments variance components of a [seeds, clusters] difference table."""
    d = np.asarray(d_SxC, np.float64)
    if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 2:
        raise ValueError(f"need >= 2 seeds and >= 2 clusters, got a table of shape {d.shape}")
    ms = stats.mean_squares(d)
    return Components(
        mean=ms.mean,
        var_seed=float(max(0.0, (ms.seed - ms.resid) / ms.clusters)),
        var_item=float(max(0.0, (ms.cluster - ms.resid) / ms.seeds)),
        var_resid=ms.resid,
        seeds=ms.seeds,
        clusters=ms.clusters,
    )


def expected_mean_squares(comp: Components, seeds: int) -> stats.MeanSquares:
    """The verdict's mean squares expected with `seeds` seeds on the pilot's clusters."""
    c = comp.clusters
    return stats.MeanSquares(
        mean=comp.mean,
        seed=c * comp.var_seed + comp.var_resid,
        cluster=seeds * comp.var_item + comp.var_resid,
        resid=comp.var_resid,
        seeds=seeds,
        clusters=c,
    )


def power(comp: Components, seeds: int, *, margin: float, level: float, delta: float) -> float:
    """P(the verdict's lower bound > -margin) with `seeds` seeds (module docstring)."""
    import scipy.stats  # here, not at the top: it takes seconds to import

    half, df = expected_mean_squares(comp, seeds).half_width(level)
    q = float(scipy.stats.t.ppf(0.5 + level / 2.0, df))
    if half == 0.0:
        return 1.0 if delta + margin > 0 else 0.0
    return float(scipy.stats.t.cdf((delta + margin) / (half / q) - q, df))


def seeds_needed(
    comp: Components,
    *,
    margin: float,
    level: float,
    delta: float,
    target: float,
    max_seeds: int = 64,
) -> int | None:
    """The fewest seeds (>= stats.MIN_SEEDS) whose power reaches `target`, None up to
    `max_seeds`."""
    for s in range(stats.MIN_SEEDS, max_seeds + 1):
        if power(comp, s, margin=margin, level=level, delta=delta) >= target:
            return s
    return None


def clusters_needed(
    comp: Components, *, margin: float, level: float, delta: float, target: float
) -> int | None:
    """Clusters needed when seeds alone cannot reach the target: with infinitely many seeds
    se^2 -> var_i / C, so C >= var_i * ((z_a + z_p) / (delta + margin))^2."""
    if delta + margin <= 0:
        return None
    z = NormalDist().inv_cdf(1.0 - (1.0 - level) / 2.0) + NormalDist().inv_cdf(target)
    return int(np.ceil(comp.var_item * (z / (delta + margin)) ** 2)) if comp.var_item else 1


def pilot_table(workdir: str, candidate: str, baseline: str, metric: str) -> np.ndarray:
    """The paired [seeds, clusters] table of `metric` differences from a pilot's runs."""
    runs: dict[str, dict[int, list]] = {candidate: {}, baseline: {}}
    for path in sorted(glob.glob(os.path.join(workdir, "runs", "*", HELDOUT_FILE))):
        m = _RUN.match(os.path.basename(os.path.dirname(path)))
        if m and m["arm"] in runs:
            runs[m["arm"]][int(m["seed"])] = load_records(path)
    common = sorted(set(runs[candidate]) & set(runs[baseline]))
    if len(common) < 2:
        raise ValueError(
            f"{workdir}: the pilot needs >= 2 training seeds of both {candidate!r} and "
            f"{baseline!r} (found seeds {sorted(runs[candidate])} and {sorted(runs[baseline])})"
        )
    rows = []
    for s in common:
        ids, cand = stats.task_means(runs[candidate][s], "plain")
        ids_b, base = stats.task_means(runs[baseline][s], "plain")
        if ids != ids_b:
            raise ValueError(f"seed {s}: the arms were evaluated on different held-out tasks")
        clusters = stats.task_clusters([runs[candidate][s]], ids)
        rows.append(stats.cluster_table((cand[metric] - base[metric])[None, :], clusters)[0])
    return np.asarray(rows)


def report(
    comp: Components,
    *,
    margin: float,
    level: float,
    delta: float,
    target: float,
    max_seeds: int = 12,
) -> str:
    """The components, a power table and the answer, as text."""
    lines = [
        f"pilot: {comp.seeds} seeds x {comp.clusters} clusters, mean difference {comp.mean:+.4f}",
        f"variance components: seed {comp.var_seed:.6f}, item (cluster) {comp.var_item:.6f}, "
        f"residual {comp.var_resid:.6f}",
        f"non-inferiority at margin {margin}, level {level}, true difference {delta:+g}:",
    ]
    for s in range(stats.MIN_SEEDS, max_seeds + 1):
        p = power(comp, s, margin=margin, level=level, delta=delta)
        half, df = expected_mean_squares(comp, s).half_width(level)
        lines.append(
            f"  {s:3d} seeds: se {comp.se(s):.4f}, interval +-{half:.4f} (df {df:.1f}), "
            f"power {p:.3f}"
        )
    need = seeds_needed(comp, margin=margin, level=level, delta=delta, target=target)
    if need is not None:
        lines.append(f"seeds needed for power {target}: {need}")
    else:
        c = clusters_needed(comp, margin=margin, level=level, delta=delta, target=target)
        lines.append(
            f"power {target} is not reached with up to 64 seeds on {comp.clusters} clusters: "
            "the held-out items' own variance dominates"
            + (f"; about {c} clusters would be needed" if c else "")
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", required=True, help="a finished pilot run of both arms")
    p.add_argument("--candidate", default="tg")
    p.add_argument("--baseline", default="grpo")
    p.add_argument("--metric", default="task_success")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--power", type=float, default=0.8)
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--delta", type=float, default=0.0, help="the true difference to power for")
    args = p.parse_args(argv)
    try:
        comp = components(pilot_table(args.workdir, args.candidate, args.baseline, args.metric))
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {e}")
        return 2
    print(report(comp, margin=args.margin, level=args.level, delta=args.delta, target=args.power))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
