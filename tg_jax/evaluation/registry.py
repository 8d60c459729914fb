"""One registry of every pre-registered hypothesis test, and the correction for re-registering.

A run that tests a registered hypothesis sets `eval.hypothesis` (a stable id, e.g.
"fence/tg-vs-grpo") and `eval.registry` (a JSONL file; the project's is
docs/preregistrations.jsonl). Before its first RL step the run appends its registration to
the file:

    {"id": "fence/tg-vs-grpo#3", "hypothesis": ..., "date", "config" (the sha256 of the
     workdir's preregistration.json), "candidate", "baseline", "seeds", "margin", "level",
     "interval", "machine", "earlier": [ids], "workdir", "outcome": null}

and when its report is written, one line {"id", "date", "outcome": {"verdict", "difference",
"low", "high", "level"}}. Lines are only ever appended; a reader merges them by id.

Registering a hypothesis that the file already holds is refused unless the run names every
earlier attempt (`eval.earlier`, their ids): nothing forces a failed verdict to be forgotten.
The verdict of attempt k then splits the error rate over the k attempts (Bonferroni): its
interval is two-sided at level 1 - (1 - eval.level) / k (`corrected_level`), and the report
lists the attempts.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from tg_jax import paths
from tg_jax.errors import ConfigError


class RegistryError(ConfigError):
    """A registration that the registry refuses (earlier attempts not named, a bad file)."""


def read(path: str) -> dict[str, dict[str, Any]]:
    """{id: entry} with every outcome line merged into its entry (the last outcome wins)."""
    out: dict[str, dict[str, Any]] = {}
    p = paths.as_path(path)
    if not p.exists():
        return out
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            key = rec["id"]
        except (ValueError, KeyError, TypeError) as e:
            raise RegistryError(f"{path}:{n}: not a registry line ({e})") from e
        entry = out.setdefault(key, {})
        outcome = rec.get("outcome")
        entry.update({k: v for k, v in rec.items() if k != "outcome"})
        if outcome is not None or "outcome" not in entry:
            entry["outcome"] = outcome
    return out


def attempts(entries: dict[str, dict[str, Any]], hypothesis: str) -> list[str]:
    """The ids of the registered attempts of `hypothesis`, in order of registration."""
    return [k for k, e in entries.items() if e.get("hypothesis") == hypothesis]


def corrected_level(level: float, earlier: int) -> float:
    """The two-sided level of attempt `earlier + 1`: the error rate 1 - level split over the
    attempts (Bonferroni)."""
    return 1.0 - (1.0 - float(level)) / (int(earlier) + 1)


def check(ev: Any, workdir: str) -> None:
    """At start-up, before any work: `ev.earlier` names every attempt of `ev.hypothesis` in
    `ev.registry` other than this workdir's own (a resumed run)."""
    if not ev.get("hypothesis"):
        return
    if not ev.get("registry"):
        raise RegistryError(
            f"eval.hypothesis={ev.hypothesis!r} needs eval.registry (a JSONL file, e.g. "
            "docs/preregistrations.jsonl)"
        )
    entries = read(ev.registry)
    known = [k for k in attempts(entries, ev.hypothesis)
             if entries[k].get("workdir") != os.fspath(workdir)]  # fmt: skip
    _check_named(ev, known)


def _check_named(ev: Any, known: list[str]) -> None:
    named = list(ev.get("earlier", ()))
    if sorted(known) != sorted(named):
        raise RegistryError(
            f"hypothesis {ev.hypothesis!r} has {len(known)} earlier attempt(s) in {ev.registry}: "
            f'{known}; name each of them (--config.eval.earlier="({", ".join(map(repr, known))}'
            f"{',' if len(known) == 1 else ''})\"; their verdicts stand and this attempt's error "
            f"rate is split over {len(known) + 1}), not {named}"
        )


def register(ev: Any, record: dict[str, Any], prereg_sha256: str, workdir: str) -> str:
    """Appends this run's registration to `ev.registry` once (a resumed run finds its own
    entry by the pre-registration's sha256) and returns its id.

    Raises:
      RegistryError: the registry holds attempts of `ev.hypothesis` that `ev.earlier` does
        not name (or names ids the registry does not hold).
    """
    entries = read(ev.registry)
    done = [k for k, e in entries.items() if e.get("config") == prereg_sha256
            and e.get("hypothesis") == ev.hypothesis]  # fmt: skip
    if done:
        return done[0]
    known = attempts(entries, ev.hypothesis)
    _check_named(ev, known)
    key = f"{ev.hypothesis}#{len(known) + 1}"
    entry = {
        "id": key, "hypothesis": ev.hypothesis,
        "date": datetime.date.today().isoformat(), "config": prereg_sha256,
        "candidate": record.get("candidate"), "baseline": record.get("baseline"),
        "seeds": list(record.get("seeds") or []), "margin": record.get("margin"),
        "level": record.get("level"), "interval": record.get("ni_interval"),
        "machine": record.get("machine", ""), "earlier": known,
        "workdir": os.fspath(workdir), "outcome": None,
    }  # fmt: skip
    _append(ev.registry, entry)
    return key


def record_outcome(registry: str, key: str, ni: dict[str, Any]) -> None:
    """Appends the verdict of attempt `key` (the report's noninferiority dict)."""
    outcome = {"verdict": ni.get("verdict"), "difference": ni.get("mean"),
               "low": ni.get("lower"), "level": ni.get("level")}  # fmt: skip
    _append(registry, {"id": key, "date": datetime.date.today().isoformat(), "outcome": outcome})


# An attempt's outcome: a report's verdict, or "abandoned" (stopped before its verdict, with
# the reason; it still counts as an attempt in the correction).
OUTCOMES = ("pass", "fail", "exploratory", "not meaningful", "abandoned")


def record_abandoned(registry: str, key: str, why: str) -> None:
    """Appends that attempt `key` was stopped before its verdict, and why."""
    if key not in read(registry):
        raise RegistryError(f"{registry}: no registered attempt {key!r}")
    outcome = {"verdict": "abandoned", "why": why}
    _append(registry, {"id": key, "date": datetime.date.today().isoformat(), "outcome": outcome})


def _append(path: str, rec: dict[str, Any]) -> None:
    p = paths.as_path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = p.read_text() if p.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    p.write_text(text + json.dumps(rec, sort_keys=True) + "\n")
