"""What a step on the workers came to (`outcome`), from gcloud's exit status and the exit
status each worker printed behind `EXIT_MARK`: done, stop (a config error, a base model that
failed its gates, a fault the run cannot go past, the fit check's refusal) or retry (a
preemption, a lost ssh connection, a signal, a crash). `tg_jax.tpu.launch` acts on it.

Only the standard library: the launcher runs without JAX.
"""

from __future__ import annotations

import dataclasses
import re

from tg_jax.tpu.pod_commands import EXIT_MARK

# The exit statuses of `tg_jax.main` (tg_jax.cli's USAGE_ERROR, GATE_ERROR, RUN_ERROR;
# tg_jax.checkpointing.PREEMPTED_EXIT_CODE) and of ssh: (action, meaning).
EXIT_RULES = {
    0: ("done", "finished"),
    2: ("stop", "a config error (exit 2): change the config and launch again"),
    3: ("stop", "the base model failed its gates (exit 3)"),
    4: ("stop", "a fault the run cannot go past (exit 4); the error line says what was kept"),
    143: ("retry", "preempted (exit 143); the rerun resumes from the last checkpoint"),
    255: ("retry", "ssh failed (exit 255)"),
}
PREEMPTED = 143
# The start-up fit check's refusal (tg_jax.tpu.fit.FitError), whatever the exit status.
_FIT_FAILURE = re.compile(r"does not fit its devices' memory|FitError")


def exit_rule(code: int) -> tuple[str, str]:
    """("done" | "stop" | "retry", what the exit status means) for one worker's status."""
    if code in EXIT_RULES:
        return EXIT_RULES[code]
    if code > 128 or code < 0:  # a shell's 128 + N, or Popen's -N
        return "retry", f"killed by signal {code - 128 if code > 0 else -code} (exit {code})"
    return "retry", f"crashed (exit {code})"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a step on the workers came to, and what the launcher does next."""

    action: str  # "done", "retry" or "stop"
    code: int  # the failing workers' status (the launcher's own when it stops here)
    why: str
    error: str = ""  # the last `error: ...` line the workers printed


def worker_codes(output: str, step: str) -> list[int]:
    """The exit statuses the workers printed behind EXIT_MARK for `step`."""
    pattern = re.compile(rf"{re.escape(EXIT_MARK)} {re.escape(step)} (-?\d+)\b")
    return [int(m.group(1)) for m in pattern.finditer(output)]


def error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if re.search(r"\berror: ", ln)]
    return lines[-1] if lines else ""


def outcome(rc: int, output: str, n_workers: int, step: str) -> Outcome:
    """The step's outcome from gcloud's exit status `rc` and the workers' output: done when
    all `n_workers` printed 0; stop on a status `exit_rule` stops on (or the fit check's
    refusal); else retry, a preemption first among the failures."""
    codes, error = worker_codes(output, step), error_line(output)
    if fit := [ln.strip() for ln in output.splitlines() if _FIT_FAILURE.search(ln)]:
        return Outcome("stop", 2, "the config does not fit the chips' memory (fit check)", fit[-1])
    if len(codes) >= n_workers and not any(codes):
        return Outcome("done", 0, "finished")
    failed = [c for c in codes if c] or ([rc] if rc else [])
    if not failed:
        why = f"{len(codes)} of {n_workers} workers reported an exit status (ssh lost?)"
        return Outcome("retry", 1, why, error)
    stops = [c for c in failed if exit_rule(c)[0] == "stop"]
    code = stops[0] if stops else PREEMPTED if PREEMPTED in failed else failed[0]
    action, why = exit_rule(code)
    return Outcome(action, code, why, error)
