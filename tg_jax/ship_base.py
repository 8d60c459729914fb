"""Writes a shipped base (tg_jax.train.shipped_base) with its provenance.

    python -m tg_jax.ship_base --config=configs/fence.py --workdir=W --name=fence \
        [--config.sft.retry_seeds=2 ...]

trains the base of the config the way `sft.source = "train"` does (`pipeline.run_base_model`:
dev selection, extension, gates, retry; a rerun in the same W resumes and reuses finished
attempts) and writes it to `tg_jax/bases/NAME/`; `--from_workdir` ships instead the accepted base
of a finished main job in W (`W/base_model/`, no training). The config's own sft.source is
ignored here: this is how a base is made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from absl import app, flags

from tg_jax import cli
from tg_jax import main as main_lib  # --config and --workdir, parsed as the main job's
from tg_jax.evaluation import protocol
from tg_jax.models import ModelConfig, hf_dir
from tg_jax.train import pipeline, sft, shipped_base
from tg_jax.train.sft_gates import BaseModelGateError

_NAME = flags.DEFINE_string("name", None, "The base's name under tg_jax/bases (or a directory).")
_FROM_WORKDIR = flags.DEFINE_bool(
    "from_workdir", False, "Ship the base of the finished main job in --workdir (no training)."
)
_MADE_BY = flags.DEFINE_string("made_by", "", "With --from_workdir: the command that ran it.")
_REMEASURE = flags.DEFINE_bool(
    "remeasure",
    False,
    "Measure the shipped base NAME again with the config's sft.eval (its "
    "dev tasks) and record the figures in its provenance (the weights are unchanged).",
)
flags.mark_flag_as_required("name")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(shipped_base.BASES_DIR),
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(config: Any, workdir: str, name: str, command: str) -> str:
    """Trains the base of `config` in `workdir` (`pipeline.run_base_model`), writes it as
    shipped base `name` with its provenance, and returns the directory."""
    cfg = pipeline.train_source(config)
    params, result, attempts = pipeline.run_base_model(cfg, workdir)
    sft_dir = attempts[-1]["workdir"]
    out = shipped_base.resolve(name)
    with tempfile.TemporaryDirectory(prefix="tg_shipped_base_") as tmp:
        sft.write_tokenizer_files(cfg, sft_dir, tmp)
        model_config = pipeline.base_config(cfg, sft_dir).model
        hf_dir.export_model_dir(tmp, params, ModelConfig.from_config(model_config))
        prov = {
            "name": name,
            "command": command,
            "commit": _commit(),
            "machine": protocol.machine_info(),
            "sft_eval": result,
            "attempts": [
                {k: a[k] for k in ("attempt", "seed", "data_seed", "verdict")} for a in attempts
            ],
            "sha256": shipped_base.sha256(os.path.join(tmp, shipped_base.WEIGHTS_FILE)),
        }
        init = shipped_base.sft_init(cfg)
        if init is not None:  # the base SFT continued from (sft.init)
            prov["init"] = {"base": str(cfg.sft.init), "sha256": init[1]["sha256"]}
        with open(os.path.join(tmp, shipped_base.PROVENANCE_FILE), "w", encoding="utf-8") as f:
            json.dump(prov, f, indent=1, sort_keys=True)
            f.write("\n")
        if os.path.exists(out):
            shutil.rmtree(out)
        shutil.copytree(tmp, out)
    print(f"shipped base {name}: {out} (sha256 {prov['sha256']})")
    return out


def ship_from_workdir(workdir: str, name: str, command: str) -> str:
    """Ships the accepted base of a finished main job (`workdir/base_model`, its
    sft_eval.json, and from its report the machine and the SFT attempts) as base `name`;
    the commit is the one checked out where `workdir` lies, if any."""
    base = os.path.join(workdir, "base_model")
    with open(os.path.join(workdir, "sft_eval.json"), encoding="utf-8") as f:
        result = json.load(f)
    with open(os.path.join(workdir, "report", "results.json"), encoding="utf-8") as f:
        context = json.load(f).get("context") or {}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(workdir)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    prov = {
        "name": name,
        "command": command,
        "commit": commit,
        "machine": context.get("machine") or {},
        "sft_eval": result,
        "attempts": [
            {k: a.get(k) for k in ("attempt", "seed", "data_seed", "verdict")}
            for a in context.get("sft_attempts") or []
        ],
        "sha256": shipped_base.sha256(os.path.join(base, shipped_base.WEIGHTS_FILE)),
    }
    out = shipped_base.resolve(name)
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(base, out)
    with open(os.path.join(out, shipped_base.PROVENANCE_FILE), "w", encoding="utf-8") as f:
        json.dump(prov, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"shipped base {name}: {out} (sha256 {prov['sha256']})")
    return out


def main(argv: list[str]) -> None:
    del argv
    from tg_jax.tpu import distributed  # noqa: PLC0415

    workdir, name = main_lib._WORKDIR.value, _NAME.value
    if _FROM_WORKDIR.value:
        needed = ("base_model/model.safetensors", "sft_eval.json", "report/results.json")
        if missing := [n for n in needed if not os.path.exists(os.path.join(workdir, n))]:
            print(
                f"error: {workdir} is not a finished main job (no {', '.join(missing)})",
                file=sys.stderr,
            )
            sys.exit(2)
        ship_from_workdir(workdir, name, _MADE_BY.value or f"the main job in {workdir}")
        return
    distributed.initialize_from_env()  # the CPU thread pool tg_jax.main runs SFT with
    command = "python -m tg_jax.ship_base " + " ".join(sys.argv[1:])
    if _REMEASURE.value:
        shipped_base.remeasure(main_lib._CONFIG.value, name, command, _commit())
        return
    try:
        write(main_lib._CONFIG.value, workdir, name, command)
    except BaseModelGateError as e:  # a measured outcome: no base is written
        print(f"error: {e}", file=sys.stderr)
        sys.exit(cli.GATE_ERROR)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
