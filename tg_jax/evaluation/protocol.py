"""What a report's numbers stand on: the pre-registration file and the machine.

    preregister(config, workdir, arms_configs)   before the first RL step: writes
                                                 workdir/preregistration.json, or checks it
    check_preregistration(config, workdir, arms_configs) -> {"path", "sha256"}   at report time
    machine_info() -> {"cpu_model", "cpu_family", "cpu_model_number", "cpu_count", "jax",
                       "jaxlib", "xla_flags"}

The pre-registration holds the non-inferiority margin, the floor, the interval kind, baseline,
candidate and every arm's full config. Once written it is never rewritten: a config whose
margin, floor, interval or arms differ from it is refused with a clear error, so a verdict
cannot be obtained by moving the goalposts after seeing results.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError
from tg_jax.evaluation import registry

PREREGISTRATION_FILE = "preregistration.json"
# The fields compared between the file and the config (besides the arms' configs).
EVAL_FIELDS = ("margin", "floor", "ni_interval", "baseline", "candidate", "level", "hypothesis",
               "earlier", "references")  # fmt: skip
# Fields of the arms' configs that are no part of the protocol: asking to read the held-out
# tasks again (the read is recorded and the report lists it) changes no setting of a run.
NOT_REGISTERED = (("eval", "reread_heldout"),)


class PreregistrationMismatch(ConfigError):
    """The config's margin / floor / arms differ from the workdir's preregistration.json."""


def preregistration(config: Any, arms_configs: Mapping[str, Any]) -> dict[str, Any]:
    """The pre-registration record of `config` (JSON-ready). A checkpoint directory is
    recorded by its contents (`hf_dir.fingerprint`), not by where it lies: every worker of a
    pod reads its own copy, and a moved checkpoint is the same model."""
    ev = config.eval
    record = {k: ev.get(k) for k in EVAL_FIELDS}
    record["arms"] = {arm: _plain(cfg.to_dict()) for arm, cfg in arms_configs.items()}
    for arm in record["arms"].values():
        for section, field in NOT_REGISTERED:
            (arm.get(section) or {}).pop(field, None)
        model = arm.get("model") or {}
        if model.get("hf_checkpoint"):
            from tg_jax.models import hf_dir  # noqa: PLC0415

            model["hf_checkpoint"] = hf_dir.fingerprint(model["hf_checkpoint"])
    return json.loads(json.dumps(_plain(record)))


def _plain(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    return x


def preregister(config: Any, workdir: str, arms_configs: Mapping[str, Any]) -> dict[str, str]:
    """Writes workdir/preregistration.json if absent, else checks it; with `eval.hypothesis`,
    registers the run in `eval.registry` once (`registry.register`). Returns {path, sha256}
    (and "registry_id" when registered).

    Raises:
      PreregistrationMismatch: the file differs from the config (`check_preregistration`).
      registry.RegistryError: a hypothesis without a registry, or its earlier attempts not named.
    """
    ev = config.eval
    registry.check(ev, workdir)
    path = paths.as_path(workdir) / PREREGISTRATION_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        record = preregistration(config, arms_configs)
        paths.write_json_atomic(path, record, indent=1, sort_keys=True)
    out = check_preregistration(config, workdir, arms_configs)
    if ev.get("hypothesis"):
        record = {**{k: ev.get(k) for k in EVAL_FIELDS}, "seeds": list(ev.get("train_seeds", ())),
                  "machine": machine_info()["cpu_model"]}  # fmt: skip
        out["registry_id"] = registry.register(ev, record, out["sha256"], workdir)
    return out


def check_preregistration(
    config: Any, workdir: str, arms_configs: Mapping[str, Any]
) -> dict[str, str]:
    """{path, sha256} of workdir/preregistration.json after checking it matches `config`.

    Raises:
      PreregistrationMismatch: the file is missing, or margin, floor, interval kind, baseline,
        candidate, level or an arm (name or config) differ from the config.
    """
    path = paths.as_path(workdir) / PREREGISTRATION_FILE
    if not path.exists():
        raise PreregistrationMismatch(f"{path} is missing: the RL runs were not pre-registered")
    raw = path.read_bytes()
    stored, now = json.loads(raw), preregistration(config, arms_configs)
    # A field added after the file was written is absent there: equal when empty.
    diffs = [f"eval.{k}: file {stored.get(k)!r}, config {now[k]!r}" for k in EVAL_FIELDS
             if stored.get(k) != now[k] and (k in stored or now[k] not in (None, []))]  # fmt: skip
    old_arms, new_arms = stored.get("arms", {}), now["arms"]
    if sorted(old_arms) != sorted(new_arms):  # the file's keys are sorted; order is no setting
        diffs.append(f"arms: file {sorted(old_arms)}, config {sorted(new_arms)}")
    else:
        diffs += [f"arm {a!r}: its config differs" for a in new_arms if old_arms[a] != new_arms[a]]
    if diffs:
        raise PreregistrationMismatch(
            f"the config differs from the pre-registration {path}:\n  " + "\n  ".join(diffs)
            + "\nRun with the registered settings, or use a new workdir for a new protocol "
            "(deleting the file after seeing results defeats its purpose)."
        )  # fmt: skip
    return {"path": os.fspath(path), "sha256": hashlib.sha256(raw).hexdigest()}


def machine_info() -> dict[str, Any]:
    """CPU model (/proc/cpuinfo), core count, jax / jaxlib versions and XLA_FLAGS."""
    import jax
    import jaxlib

    cpu, fields = "unknown", {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block is enough
                    break
        cpu = fields.get("model name", cpu)
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cpu_family": fields.get("cpu family", "unknown"),
        "cpu_model_number": fields.get("model", "unknown"),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
