"""What a report's numbers stand on: the pre-registration file, the held-out draw, the machine.

    preregister(config, workdir, arms_configs)   before the first RL step: writes
                                                 workdir/preregistration.json, or checks it;
                                                 a registered claim: its attempt and draw
    check_preregistration(config, workdir, arms_configs) -> {"path", "sha256"}   at report time
    heldout_tasks(config, workdir, sources)      the tasks the final evaluations read
    attempt_of(workdir) -> the registered attempt (workdir/attempt.json) or None
    machine_info() -> {"cpu_model", "cpu_family", "cpu_model_number", "cpu_count", "jax",
                       "jaxlib", "xla_flags"}

The pre-registration holds the non-inferiority margin, the floor, the interval kind, baseline,
candidate and every arm's full config. Once written it is never rewritten: a config whose
margin, floor, interval or arms differ from it is refused with a clear error, so a verdict
cannot be obtained by moving the goalposts after seeing results.

A run that tests a claim (`eval.hypothesis`, `eval.registry`) registers an attempt of it
(`registry.register`: the claim's key from `claim_parts`, the base model by `weights_sha256`)
and draws that attempt's own held-out tasks (`draw_tasks`): units (coding functions, SWE
repositories, a plug-in's or a task file's tasks) read by no earlier attempt of the claim and
in no training task, from the seed the registration fixed. workdir/attempt.json records the
attempt, its draw and its task records; every final evaluation of the run reads those tasks
(`heldout_tasks`), and its results go to the attempt's ledger (`tg_jax.evaluation.ledger`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from tg_jax import multihost, paths
from tg_jax.errors import ConfigError
from tg_jax.evaluation import ledger, registry

PREREGISTRATION_FILE = "preregistration.json"
# The fields compared between the file and the config (besides the arms' configs).
# (eval.earlier is the registry's to know: a claim's attempts are found by its derived key.)
EVAL_FIELDS = (
    "margin",
    "floor",
    "collapse_drop",
    "baseline",
    "candidate",
    "level",
    "hypothesis",
    "references",
)
ATTEMPT_FILE = "attempt.json"
BASE_WEIGHTS_FILE = "base_weights.json"
# The metric every verdict compares (a part of the claim's key).
METRIC = "heldout task_success (plain prompts)"
# A generated or file pool of held-out functions / tasks is shared by a claim's attempts:
# each draws this share of it (a quarter: four attempts, by which alpha/2^k has spent 94%).
ATTEMPTS_PER_POOL = 4
# Fields of the arms' configs that are no part of the protocol: asking to read the held-out
# tasks again (the read is recorded and the report lists it) changes no setting of a run, nor
# does writing its rollouts to disk (rl_loop.dump_rollouts).
NOT_REGISTERED = (("eval", "reread_heldout"), ("pipeline", "sitting"), ("rl_loop", "dump_rollouts"))


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
        record = {
            **{k: ev.get(k) for k in EVAL_FIELDS},
            "seeds": list(ev.get("train_seeds", ())),
            "machine": machine_info()["cpu_model"],
        }
        attempt = register_attempt(config, workdir, record, out["sha256"])
        out["registry_id"], out["earlier"] = attempt["id"], list(attempt["earlier"])
        out["level"] = attempt["level"]
    return out


def claim_parts(config: Any, base_dir: str, cache: str | None = None) -> dict[str, Any]:
    """The parts of the claim `config` tests (`registry.CLAIM_PARTS`): the environment (its
    kind; a coding one with its task families), its requirements, the metric, the margin,
    the candidate and baseline arms, and the base model's `weights_sha256`."""
    return {**claim_parts_without_base(config), "base_sha256": weights_sha256(base_dir, cache)}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".npz", ".gguf")


def weights_sha256(model_dir: str, cache: str | None = None) -> str:
    """The sha256 of a checkpoint directory's weight files (`WEIGHT_SUFFIXES`), each by name
    and every byte, in name order: not its config or tokenizer (an HF base is the same model
    whatever its header files say). `cache` (a JSON file) keeps the hash by the directory's
    `hf_dir.fingerprint`, so a large base is hashed once per workdir.

    Raises:
      ConfigError: the directory holds no weight file.
    """
    from tg_jax.models import hf_dir  # noqa: PLC0415

    local = hf_dir.stage_locally(str(model_dir))
    fp = hf_dir.fingerprint(local) if cache else ""
    if cache and os.path.exists(cache):
        stored = json.loads(open(cache, encoding="utf-8").read())
        if stored.get("fingerprint") == fp:
            return str(stored["sha256"])
    names = sorted(n for n in os.listdir(local) if n.endswith(WEIGHT_SUFFIXES))
    if not names:
        raise ConfigError(f"{model_dir}: no weight file ({', '.join(WEIGHT_SUFFIXES)})")
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        with open(os.path.join(local, name), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    out = h.hexdigest()
    if cache:
        paths.write_json_atomic(cache, {"fingerprint": fp, "sha256": out})
    return out


def register_attempt(
    config: Any, workdir: str, record: dict[str, Any], prereg_sha256: str
) -> dict[str, Any]:
    """Registers (or finds) this run's attempt of its claim and writes workdir/attempt.json:
    the registry entry's id, claim, attempt, level, spend and held-out draw, and the drawn
    task records. A later sitting of the attempt (a new workdir, the same pre-registration)
    draws the same tasks again from the registered seed, checked against the registry."""
    from tg_jax.data import task_data  # noqa: PLC0415

    ev = config.eval
    path = paths.as_path(workdir) / ATTEMPT_FILE
    if path.exists():
        stored = json.loads(path.read_text())
        if stored.get("config") == prereg_sha256:
            return stored
    base_dir = str(config.model.hf_checkpoint or paths.as_path(workdir) / "base_model")
    cache = os.fspath(paths.as_path(workdir) / BASE_WEIGHTS_FILE)
    parts = claim_parts(config, base_dir, cache)
    sources = task_data.prepare_tasks(config, workdir)
    trained = units_of(task_data.load_tasks(sources, "train"))
    drawn: dict[int, list[Any]] = {}

    def draw(seed: int, exclude: list[str]) -> tuple[list[str], int]:
        drawn[seed] = draw_tasks(config, seed, [*exclude, *trained])
        return sorted(set(units_of(drawn[seed]))), len(drawn[seed])

    entry = registry.register(ev, record, prereg_sha256, workdir, parts, draw)
    seed = int(entry["heldout"]["seed"])
    if seed not in drawn:  # a later sitting: the same draw from the registered seed
        earlier = registry.read_units(registry.read(ev.registry), list(entry["earlier"]))
        units, _ = draw(seed, earlier)
        if units != sorted(entry["heldout"]["units"]):
            raise registry.RegistryError(
                f"attempt {entry['id']}: the held-out draw from seed {seed} differs from the "
                f"registered one in {ev.registry} (the task generator changed since)"
            )
    out = {k: entry[k] for k in ledger.REGISTERED_FIELDS}
    out["registry"] = os.fspath(ev.registry)
    out["floor"], out["collapse_drop"] = ev.get("floor"), ev.get("collapse_drop")
    out["tasks"] = [_record(t) for t in drawn[seed]]
    if multihost.is_primary():
        paths.write_json_atomic(path, out, indent=1, sort_keys=True)
        ledger.write_attempt(out)
    return out


def claim_parts_without_base(config: Any) -> dict[str, Any]:
    """`claim_parts` but the base model's hash (computed apart, cached per workdir)."""
    from tg_jax.data import task_data  # noqa: PLC0415
    from tg_jax.envs import env_kind, requirement_names  # noqa: PLC0415

    kind = env_kind(config.env)
    env = kind
    if kind == "coding":
        env += ":" + "-".join(task_data.task_settings(config).families)
    return {
        "env": env,
        "requirements": list(requirement_names(config.env)),
        "metric": METRIC,
        "margin": float(config.eval.margin),
        "candidate": str(config.eval.candidate),
        "baseline": str(config.eval.baseline),
    }


def unit_of(task: Any) -> str:
    """A task's held-out unit, what no two attempts of a claim may share: a coding task's
    hidden function ("add:3"), else "sha:" and 16 hex digits of its content (an SWE task's
    repository, a plug-in's record) without its id and split."""
    if hasattr(task, "family") and hasattr(task, "params") and hasattr(task, "function_id"):
        return str(task.function_id)
    rec = {k: v for k, v in _record(task).items() if k not in ("task_id", "split")}
    text = json.dumps(rec, sort_keys=True, default=str)
    return "sha:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def units_of(tasks: list[Any]) -> list[str]:
    """`unit_of` each task."""
    return [unit_of(t) for t in tasks]


def _record(task: Any) -> dict[str, Any]:
    return task.to_record() if hasattr(task, "to_record") else dict(task)


def draw_tasks(config: Any, seed: int, exclude: list[str]) -> list[Any]:
    """An attempt's held-out tasks, drawn with `seed`, none of whose units is in `exclude`.

    Coding tasks generated: a 1 / ATTEMPTS_PER_POOL share of the held-out split's functions
    (`tasks.draw_heldout`), `eval.num_tasks` tasks over them. SWE or plug-in tasks generated:
    `eval.num_tasks` tasks of the held-out split generated with `seed`, repeats of an excluded
    repository or record skipped. A held-out task file (`tasks.heldout_source`): a
    1 / ATTEMPTS_PER_POOL share of its tasks not excluded (at most eval.num_tasks), sampled
    with `seed`.

    Raises:
      registry.RegistryError: too few fresh units are left for this attempt.
    """
    from tg_jax.data import task_data  # noqa: PLC0415
    from tg_jax.envs import decode_task, env_kind, tasks  # noqa: PLC0415
    from tg_jax.envs.plugins import PLUGIN_TASK_KIND, environment_class  # noqa: PLC0415

    n, gone = int(config.eval.num_tasks), set(exclude)
    t = task_data.task_settings(config)
    kind = env_kind(config.env)
    if t.heldout_source:
        records = list(task_data._file_records(config, t.heldout_source, "heldout"))
        pool = [decode_task(r) for r in records]
        share = max(1, len(pool) // ATTEMPTS_PER_POOL)
        fresh = [x for x in pool if unit_of(x) not in gone]
        if len(fresh) < min(share, n):
            raise registry.RegistryError(
                f"tasks.heldout_source {t.heldout_source!r}: {len(fresh)} task(s) are left that "
                f"no earlier attempt of the claim read; an attempt draws {min(share, n)}: give "
                "the claim fresh held-out tasks"
            )
        return random.Random(f"tg_jax.protocol:draw:{seed}").sample(fresh, min(share, n))
    if kind == "coding":
        pool = tasks.heldout_functions(t.families)
        try:
            return tasks.draw_heldout(
                n,
                seed,
                max(1, len(pool) // ATTEMPTS_PER_POOL),
                families=t.families,
                exclude=sorted(gone),
            )
        except ValueError as e:
            raise registry.RegistryError(f"the claim's held-out functions are spent: {e}") from e
    if kind == "swe":
        from tg_jax.envs.swe.generator import generate_swe_tasks  # noqa: PLC0415

        def generate(m: int) -> list[Any]:
            return generate_swe_tasks("heldout", m, seed, t.approved_share)
    else:
        cls = environment_class(kind)

        def generate(m: int) -> list[Any]:
            return [
                decode_task({**r, "kind": PLUGIN_TASK_KIND, "split": "heldout"})
                for r in cls.generate_tasks("heldout", m, seed)
            ]

    m = n
    while True:  # more tasks generated until n are fresh (and distinct)
        out, seen = [], set()
        for x in generate(m):
            u = unit_of(x)
            if u not in gone and u not in seen:
                seen.add(u)
                out.append(x)
        if len(out) >= n:
            return out[:n]
        if m >= 4 * n + 64:
            raise registry.RegistryError(
                f"{kind}: {m} held-out tasks generated with seed {seed} hold only {len(out)} "
                f"that no earlier attempt of the claim read; an attempt draws {n}"
            )
        m *= 2


def attempt_of(workdir: str) -> dict[str, Any] | None:
    """The registered attempt the runs of `workdir` belong to (workdir/attempt.json), or None."""
    path = paths.as_path(workdir) / ATTEMPT_FILE
    return json.loads(path.read_text()) if path.exists() else None


def heldout_tasks(config: Any, workdir: str, sources: Mapping[str, Any]) -> list[Any]:
    """The tasks the final evaluations of `workdir` read: its attempt's drawn tasks when the
    run tests a registered claim, else the first `eval.num_tasks` of the held-out split."""
    from tg_jax.data import task_data  # noqa: PLC0415
    from tg_jax.envs import decode_task  # noqa: PLC0415

    attempt = attempt_of(workdir)
    if attempt is None:
        return task_data.load_tasks(dict(sources), "heldout", config.eval.num_tasks)
    return [decode_task(r) for r in attempt["tasks"]]


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
    diffs = [
        f"eval.{k}: file {stored.get(k)!r}, config {now[k]!r}"
        for k in EVAL_FIELDS
        if stored.get(k) != now[k] and (k in stored or now[k] not in (None, []))
    ]
    old_arms, new_arms = stored.get("arms", {}), now["arms"]
    if sorted(old_arms) != sorted(new_arms):  # the file's keys are sorted; order is no setting
        diffs.append(f"arms: file {sorted(old_arms)}, config {sorted(new_arms)}")
    else:
        diffs += [f"arm {a!r}: its config differs" for a in new_arms if old_arms[a] != new_arms[a]]
    if diffs:
        raise PreregistrationMismatch(
            f"the config differs from the pre-registration {path}:\n  "
            + "\n  ".join(diffs)
            + "\nRun with the registered settings, or use a new workdir for a new protocol "
            "(deleting the file after seeing results defeats its purpose)."
        )
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


def describe_draw(config: Any, workdir: str) -> str:
    """One line for the report: the held-out tasks its verdict read (the attempt's own draw,
    or the held-out split) and the one-sided alpha the attempt spends (or, unregistered, what
    a first attempt of its claim would spend)."""
    attempt = attempt_of(workdir)
    if attempt is None:
        share = registry.RULES[registry.DEFAULT_RULE](1.0 - float(config.eval.level), 1)
        return (
            f"Held-out tasks: the first {int(config.eval.num_tasks)} of the held-out split "
            f"(tasks.seed {int(config.tasks.seed)}), no registered draw; registered as a "
            f"claim's first attempt it would spend a one-sided alpha of {share:g} "
            f"(two-sided level {1.0 - 2.0 * share:g})."
        )
    d, spend = attempt["heldout"], attempt["spend"]
    return (
        f"Held-out tasks: attempt {attempt['id']}'s own draw (seed {d['seed']}, "
        f"{len(d['units'])} unit(s) read by no earlier attempt, {d['tasks']} tasks); it spends "
        f"a one-sided alpha of {spend['share']:g} of the claim's {spend['alpha']:g} "
        f"({spend['rule']}; two-sided level {attempt['level']:.4g})."
    )


def record_run(
    cfg: Any, workdir: str, arm: str, seed: int | None, records: Sequence[Any], policy_dir: str
) -> str | None:
    """The pipeline's hook after a run's final evaluation: its ledger file when the workdir's
    runs belong to a registered attempt (`attempt_of`), else nothing (None)."""
    attempt = attempt_of(workdir)
    if attempt is None or not multihost.is_primary():
        return None
    return ledger.write_run(
        attempt,
        arm,
        seed,
        ledger.outcomes(records),
        policy_sha256=weights_sha256(policy_dir),
        commit=ledger.git_commit(),
        config=json.loads(json.dumps(cfg.to_dict(), default=str)),
        machine=machine_info(),
    )
