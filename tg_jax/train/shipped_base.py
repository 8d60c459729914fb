"""The embedded configs' base models, trained once and shipped with the package.

SFT of the 0.43M byte model is chaotic: it moves with the seed and with the CPU's float
reduction order, so a base trained on each machine is a different model. The embedded configs
(default, fence, joint) therefore start RL from a base shipped in `tg_jax/bases/<name>/`
(`sft.source = "shipped"`, `sft.base = name`): the same file on every machine. Each is a
checkpoint directory in the format of `W/base_model/` (config.json, model.safetensors, the byte
tokenizer's files, Qwen3's chat template) with `provenance.json` beside it: the command, commit
and machine that made it, its `sft_eval.json` figures, the SFT attempts and the sha256 of the
weights.

`python -m tg_jax.ship_base` writes one (its docstring). A run from a shipped base checks
the weights' sha256 and the architecture against the config, applies the gates to the recorded
figures, and copies the directory to `W/base_model/`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError

BASES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bases")
PROVENANCE_FILE = "provenance.json"
WEIGHTS_FILE = "model.safetensors"
SOURCES = ("shipped", "train")


def check_source(value: str) -> str:
    """`sft.source` as given, or a ConfigError naming the choices (SftConfig's check too)."""
    if value not in SOURCES:
        raise ConfigError(f"sft.source must be one of {', '.join(SOURCES)}, got {value!r}")
    return value


def source(config: Any) -> str:
    """`sft.source`, checked: "shipped" (the default of the embedded configs) or "train"
    (read with a default: saved configs of older workdirs lack it)."""
    return check_source(str(config.sft.get("source", "train")))


def resolve(name: str) -> str:
    """A base's directory: a name under tg_jax/bases, or a path (it has a separator)."""
    return name if os.sep in name else os.path.join(BASES_DIR, name)


def base_dir(config: Any) -> str:
    """The shipped base's directory: `sft.base`, a name under tg_jax/bases or a path."""
    name = str(config.sft.get("base", ""))
    if not name:
        raise ConfigError("sft.source='shipped' needs sft.base (a name under tg_jax/bases)")
    return resolve(name)


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
    """(the shipped base's directory, its provenance), after `check_directory`.

    Raises:
      ConfigError: a missing base, weights that are not the recorded ones, or an architecture
        that differs from `config.model`; the message says how to write a base or train one.
    """
    directory = base_dir(config)
    how = (
        f"write one with `python -m tg_jax.ship_base --config=CONFIG --workdir=W "
        f"--name={os.path.basename(directory)}`, or train the base in the run with "
        "--config.sft.source=train"
    )
    return directory, check_directory(config, directory, "sft.source='shipped'", how)


def check_directory(
    config: Any, directory: str, what: str, how: str, *, any_context: bool = False
) -> dict[str, Any]:
    """The provenance of the base in `directory`, after checking that it exists, that its
    weights are the recorded ones (sha256) and that its architecture is `config.model`'s
    (its context `model.max_seq_len` too, unless `any_context`).

    Raises:
      ConfigError: "`what`: <the problem>; `how`" (missing, changed or mismatched).
    """
    if not os.path.exists(os.path.join(directory, PROVENANCE_FILE)):
        raise ConfigError(f"{what}: no shipped base in {directory}; {how}")
    prov = read_provenance(directory)
    got = sha256(os.path.join(directory, WEIGHTS_FILE))
    if got != prov["sha256"]:
        raise ConfigError(
            f"{what}: {directory}/{WEIGHTS_FILE} has sha256 {got}, its "
            f"provenance records {prov['sha256']}: the file was changed; restore it or {how}"
        )
    from tg_jax.models import hf_dir  # noqa: PLC0415 (jax: only when a run uses it)

    model = config.model
    if any_context:  # resolve_model_section then takes the base's context
        model = {**(model.to_dict() if hasattr(model, "to_dict") else model), "max_seq_len": None}
    try:  # the architecture check of every checkpoint directory (tg_jax.models.hf_dir)
        hf_dir.resolve_model_section(model, hf_dir.open_model_dir(directory))
    except hf_dir.ModelDirError as e:
        raise ConfigError(f"{what}: the base does not fit the config: {e}; {how}") from None
    return prov


def sft_init(config: Any) -> tuple[str, dict[str, Any]] | None:
    """`sft.init` checked: None (SFT starts from a random init of `seed`), else (the
    directory of the shipped base SFT continues from, its provenance). The config's context
    may be longer than the base's: SFT trains it at `sft.seq_len` (rotary positions, nothing
    learnt per position).

    Raises:
      ConfigError: a missing, changed or mismatched base (`check_directory`), or a BPE
        tokenizer (trained per workdir: its ids are not the base's).
    """
    name = str(config.sft.get("init", "") or "")
    if not name:
        return None
    what = f"sft.init={name!r}"
    if str(config.sft.get("tokenizer", "byte")) != "byte":
        raise ConfigError(f"{what} needs sft.tokenizer='byte' (a BPE is trained per workdir)")
    how = "set sft.init to a name under tg_jax/bases or a shipped base's directory, or ''"
    directory = resolve(name)
    return directory, check_directory(config, directory, what, how, any_context=True)


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


def compare(recorded: dict[str, Any], measured: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each figure of the base re-measured here against the one recorded when it was made.

    For a share p over n episodes (n = `num_tasks` of each evaluation, the same held-out tasks
    and sampling seed), the 95% interval of a difference of two independent shares is
    +- 1.96 sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2); `beyond` marks a difference outside it.
    Turn-level compliance is judged over more turns than episodes, so n = episodes makes its
    interval wider than its own: a flagged difference is a real one.

    Returns:
      {figure: {"recorded", "measured", "difference", "interval", "beyond"}} for the pass
      rates and compliance figures both evaluations have.
    """
    n1, n2 = float(recorded.get("num_tasks") or 0), float(measured.get("num_tasks") or 0)
    out = {}
    for key, p1 in sorted(recorded.items()):
        p2 = measured.get(key)
        if not ("pass_rate" in key or "compliance" in key) or not isinstance(p1, int | float):
            continue
        if not isinstance(p2, int | float) or not n1 or not n2:
            continue
        half = 1.96 * math.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2)
        diff = float(p2) - float(p1)
        out[key] = {
            "recorded": float(p1),
            "measured": float(p2),
            "difference": diff,
            "interval": half,
            "beyond": abs(diff) > half + 1e-12,
        }
    return out


def remeasure(config: Any, name: str, command: str, commit: str) -> dict[str, Any]:
    """Measures shipped base `name` again (`sft_eval.measure`: the config's sft.eval on its dev
    tasks) and makes those its recorded figures; the earlier ones move to the provenance's
    `sft_eval_history` with the command, commit, machine and date (`python -m
    tg_jax.ship_base --remeasure`). Returns the new figures."""
    import datetime  # noqa: PLC0415

    from tg_jax import config_files  # noqa: PLC0415
    from tg_jax.evaluation import protocol  # noqa: PLC0415
    from tg_jax.models import ModelConfig, hf_dir  # noqa: PLC0415 (jax: only when run)
    from tg_jax.train import sft_eval  # noqa: PLC0415

    cfg = config_files.apply_overrides(config, {"sft.source": "shipped", "sft.base": resolve(name)})
    directory, prov = check(cfg)  # the recorded weights, the config's architecture
    md = hf_dir.open_model_dir(directory)
    model_cfg = ModelConfig.from_config(cfg.model)
    result = sft_eval.measure(cfg, model_cfg, md.load_params(model_cfg), md.renderer)
    for key in ("selected_step", "sft_steps", "sft_wall_s"):  # how it was made: unchanged
        if key in prov["sft_eval"]:
            result[key] = prov["sft_eval"][key]
    when = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    prov["sft_eval_history"] = [
        *prov.get("sft_eval_history", []),
        {
            "sft_eval": prov["sft_eval"],
            "replaced": when,
            "by": command,
            "commit": commit,
            "machine": protocol.machine_info(),
        },
    ]
    prov["sft_eval"] = result
    with open(os.path.join(directory, PROVENANCE_FILE), "w", encoding="utf-8") as f:
        json.dump(prov, f, indent=1, sort_keys=True)
        f.write("\n")
    headline = {k: round(v, 3) for k, v in result.items() if isinstance(v, float) and "_s" not in k}
    print(f"shipped base {name}: re-measured on {result['tasks']}: {headline}")
    return result
