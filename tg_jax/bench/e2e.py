"""End-to-end wall time of a finished main job, read from its workdir (never run here).

Sources, all optional:
  * metrics.jsonl files anywhere under the workdir: every line has a wall-clock "time"; the
    span from the first to the last line over all files is the job's logged wall time (it
    misses what ran before the first metric: data stage and the first compile);
  * sft/sft_summary.json: "wall_s" of the SFT stage (data generation + training);
  * rl_summary.json files (one per RL arm and seed): costs.wall_time_s and the arm name.

`read_workdir` returns the figures it found; an empty dict means "not measured".
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any


def _metrics_span(workdir: str) -> float | None:
    first, last = None, None
    for path in glob.glob(os.path.join(workdir, "**", "metrics.jsonl"), recursive=True):
        with open(path) as f:
            for line in f:
                try:
                    t = float(json.loads(line)["time"])
                except (ValueError, KeyError, TypeError):
                    continue  # a torn last line of a killed run, or a line without time
                first = t if first is None else min(first, t)
                last = t if last is None else max(last, t)
    return None if first is None else last - first


def _load(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_workdir(workdir: str | None) -> dict[str, float]:
    """Wall-time figures of the main job in `workdir` (seconds); {} when there are none.

    Returns:
      Any of: "metrics_span_s" (first to last logged metric), "sft_wall_s", "rl_wall_s"
      (summed over every arm and seed), "rl_wall_s/<arm>" (summed over seeds).
    """
    if not workdir or not os.path.isdir(workdir):
        return {}
    out: dict[str, float] = {}
    span = _metrics_span(workdir)
    if span is not None:
        out["metrics_span_s"] = span
    sft = _load(os.path.join(workdir, "sft", "sft_summary.json"))
    if sft and "wall_s" in sft:
        out["sft_wall_s"] = float(sft["wall_s"])
    for path in glob.glob(os.path.join(workdir, "**", "rl_summary.json"), recursive=True):
        summary = _load(path)
        wall = (summary or {}).get("costs", {}).get("wall_time_s")
        if wall is None:
            continue
        out["rl_wall_s"] = out.get("rl_wall_s", 0.0) + float(wall)
        key = f"rl_wall_s/{summary.get('arm', 'unknown')}"
        out[key] = out.get(key, 0.0) + float(wall)
    return out
