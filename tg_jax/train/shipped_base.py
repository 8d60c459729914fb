"""The embedded configs' base models, trained once and shipped with the package.

SFT of the 0.43M byte model is chaotic: it moves with the seed and with the CPU's float
reduction order, so a base trained on each machine is a different model. The embedded configs
(default, fence, joint) therefore start RL from a base shipped in `tg_jax/bases/<name>/`
(`sft.source = "shipped"`, `sft.base = name`): the same file on every machine. Each is a
checkpoint directory in the format of `W/base_model/` (config.json, model.safetensors, the byte
tokenizer's files, Qwen3's chat template) with `provenance.json` beside it: the command, commit
and machine that made it, its `sft_eval.json` figures, the SFT attempts and the sha256 of the
weights.

    python -m tg_jax.train.shipped_base --config=configs/fence.py --workdir=W --name=fence

trains a base the way `sft.source = "train"` does (`pipeline.run_base_model`: dev selection,
extension, gates, retry) and writes it as shipped base `name`. A run from a shipped base checks
the weights' sha256 and the architecture against the config, applies the gates to the recorded
figures, and copies the directory to `W/base_model/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError

BASES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bases")
PROVENANCE_FILE = "provenance.json"
WEIGHTS_FILE = "model.safetensors"
SOURCES = ("shipped", "train")


def source(config: Any) -> str:
    """`sft.source`, checked: "shipped" (the default of the embedded configs) or "train"."""
    value = str(config.sft.get("source", "train"))
    if value not in SOURCES:
        raise ConfigError(f"sft.source must be one of {', '.join(SOURCES)}, got {value!r}")
    return value


def base_dir(config: Any) -> str:
    """The shipped base's directory: `sft.base`, a name under tg_jax/bases or a path."""
    name = str(config.sft.get("base", ""))
    if not name:
        raise ConfigError("sft.source='shipped' needs sft.base (a name under tg_jax/bases)")
    return name if os.sep in name else os.path.join(BASES_DIR, name)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_provenance(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, PROVENANCE_FILE), encoding="utf-8") as f:
        return json.load(f)


def check(config: Any) -> tuple[str, dict[str, Any]]:
    """(the shipped base's directory, its provenance), after checking that it exists, that
    its weights are the recorded ones (sha256) and that its architecture is the config's.

    Raises:
      ConfigError: a missing base, weights that are not the recorded ones, or an architecture
        that differs from `config.model`; the message says how to write a base or train one.
    """
    directory = base_dir(config)
    how = (
        f"write one with `python -m tg_jax.train.shipped_base --config=CONFIG --workdir=W "
        f"--name={os.path.basename(directory)}`, or train the base in the run with "
        "--config.sft.source=train"
    )
    if not os.path.exists(os.path.join(directory, PROVENANCE_FILE)):
        raise ConfigError(f"sft.source='shipped': no shipped base in {directory}; {how}")
    prov = read_provenance(directory)
    got = sha256(os.path.join(directory, WEIGHTS_FILE))
    if got != prov["sha256"]:
        raise ConfigError(
            f"sft.source='shipped': {directory}/{WEIGHTS_FILE} has sha256 {got}, its "
            f"provenance records {prov['sha256']}: the file was changed; restore it or {how}"
        )
    from tg_jax.models import hf_dir  # noqa: PLC0415 (jax: only when a run uses it)

    try:  # the architecture check of every checkpoint directory (tg_jax.models.hf_dir)
        hf_dir.resolve_model_section(config.model, hf_dir.open_model_dir(directory))
    except hf_dir.ModelDirError as e:
        msg = f"sft.source='shipped': the base does not fit the config: {e}; {how}"
        raise ConfigError(msg) from None
    return directory, prov


def install(config: Any, workdir: str, out: str) -> dict[str, Any]:
    """Copies the checked shipped base to `out` (the workdir's base_model) once; returns its
    provenance (its recorded `sft_eval` figures are the gates' input)."""
    from tg_jax.models import hf_dir  # noqa: PLC0415 (jax: only when a run uses it)

    directory, prov = check(config)
    if not (paths.as_path(out) / "config.json").exists():
        hf_dir.copy_dir(directory, out)
    print(
        f"base: shipped {os.path.basename(directory)} (sha256 {prov['sha256'][:16]}..., made "
        f"at {prov.get('commit', '?')[:12]} on {prov.get('machine', {}).get('cpu_model', '?')})"
    )
    return prov


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(BASES_DIR),
        )  # fmt: skip
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(config: Any, workdir: str, name: str, command: str) -> str:
    """Trains the base of `config` in `workdir` (`pipeline.run_base_model`), writes it as
    shipped base `name` with its provenance, and returns the directory."""
    import tempfile  # noqa: PLC0415

    from tg_jax.data import task_data  # noqa: PLC0415
    from tg_jax.evaluation import protocol  # noqa: PLC0415
    from tg_jax.models import ModelConfig, hf_dir  # noqa: PLC0415
    from tg_jax.train import pipeline, sft  # noqa: PLC0415

    cfg = pipeline.train_source(config)
    sources = task_data.prepare_tasks(cfg, workdir)
    params, result, attempts = pipeline.run_base_model(cfg, workdir, sources)
    sft_dir = attempts[-1]["workdir"]
    out = os.path.join(BASES_DIR, name) if os.sep not in name else name
    with tempfile.TemporaryDirectory(prefix="tg_shipped_base_") as tmp:
        sft.write_tokenizer_files(cfg, sft_dir, tmp)
        model_config = pipeline.base_config(cfg, sft_dir).model
        hf_dir.export_model_dir(tmp, params, ModelConfig.from_config(model_config))
        prov = {
            "name": name, "command": command, "commit": _commit(),
            "machine": protocol.machine_info(), "sft_eval": result,
            "attempts": [{k: a[k] for k in ("attempt", "seed", "data_seed", "verdict")}
                         for a in attempts],
            "sha256": sha256(os.path.join(tmp, WEIGHTS_FILE)),
        }  # fmt: skip
        with open(os.path.join(tmp, PROVENANCE_FILE), "w", encoding="utf-8") as f:
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
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(workdir)),
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    prov = {
        "name": name, "command": command, "commit": commit,
        "machine": context.get("machine") or {}, "sft_eval": result,
        "attempts": [{k: a.get(k) for k in ("attempt", "seed", "data_seed", "verdict")}
                     for a in context.get("sft_attempts") or []],
        "sha256": sha256(os.path.join(base, WEIGHTS_FILE)),
    }  # fmt: skip
    out = os.path.join(BASES_DIR, name) if os.sep not in name else name
    if os.path.exists(out):
        shutil.rmtree(out)
    shutil.copytree(base, out)
    with open(os.path.join(out, PROVENANCE_FILE), "w", encoding="utf-8") as f:
        json.dump(prov, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"shipped base {name}: {out} (sha256 {prov['sha256']})")
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m tg_jax.train.shipped_base --config=CONFIG --workdir=W --name=NAME`."""
    import argparse  # noqa: PLC0415

    from tg_jax import config_files  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="configs/NAME.py[:arg]: train its base in --workdir")
    p.add_argument("--workdir", required=True, help="where SFT runs (data, attempts)")
    p.add_argument("--name", required=True, help="the base's name under tg_jax/bases")
    p.add_argument(
        "--from-workdir", action="store_true",
        help="ship the base of the finished main job in --workdir (no training)",
    )  # fmt: skip
    p.add_argument("--made-by", default="", help="with --from-workdir: the command that ran it")
    args = p.parse_args(argv)
    if args.from_workdir:
        ship_from_workdir(
            args.workdir, args.name, args.made_by or f"the main job in {args.workdir}"
        )
        return 0
    if not args.config:
        p.error("--config is required (or --from-workdir)")
    from tg_jax.tpu import distributed  # noqa: PLC0415

    distributed.initialize_from_env()  # the CPU thread pool tg_jax.main runs SFT with
    path, _, arg = args.config.partition(":")
    config = config_files.load_config_file(path, arg or None)
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    write(config, args.workdir, args.name, f"python -m tg_jax.train.shipped_base {args_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
