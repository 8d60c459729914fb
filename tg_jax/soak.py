"""Soak: the main job run many times, under CPU contention and preemptions, must always finish.

    python -m tg_jax.soak --config=configs/tiny.py --runs=8 --workdir=W [--config.a.b=v ...]

Each run is the pipeline stage (data, SFT, every arm with its sampling thread, held-out
evaluation, report) of `python -m tg_jax.main`, in a fresh workdir W/run_<i>, as its own
process. While the soak lasts a busy process of its own competes for the CPU (`--busy`
processes, default 1), so threads interleave as they do on a loaded machine. Every
`--kill_every`-th run (default 2: runs 1, 3, ...) gets a SIGTERM at a random moment, drawn
uniformly between 10% and 90% of the first run's wall time (`--seed` fixes the draws), and is
then rerun with the same command, which must resume and finish. A run is ok when its last
command exits 0 and its report (report/results.json) exists.

Prints one line per run and ends with `soak: K/N ok`; the exit status is 0 only when K == N.
Each command's stdout and stderr are kept in W/run_<i>/soak_<attempt>.log; a failed run's
line ends with the last line of its stderr. `TG_JAX_FAULTS` in the environment reaches every
run (tg_jax.faults).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from tg_jax.checkpointing import PREEMPTED_EXIT_CODE

BUSY = "import itertools\nfor _ in itertools.count():\n    pass\n"


@dataclasses.dataclass
class RunOutcome:
    """One soak run: its exit statuses (first command, rerun), wall time, SIGTERM time."""

    index: int
    statuses: list[int]
    wall_s: float
    sigterm_at_s: float | None
    report: bool
    last_error: str = ""

    @property
    def preempted(self) -> bool:
        """The SIGTERMed command saved and stopped as a preemption does (exit 143)."""
        return self.sigterm_at_s is not None and self.statuses[0] == PREEMPTED_EXIT_CODE

    @property
    def ok(self) -> bool:
        # A SIGTERMed run must stop as a preemption (exit 143, its work saved) or have
        # finished before the signal (exit 0); the rerun must then end with the report.
        signalled = self.sigterm_at_s is None or self.statuses[0] in (0, PREEMPTED_EXIT_CODE)
        return signalled and self.statuses[-1] == 0 and self.report

    def line(self) -> str:
        what = "ok" if self.ok else "FAIL"
        kill = ""
        if self.sigterm_at_s is not None:
            rerun = "resumed" if self.preempted else "rerun"
            kill = f", SIGTERM at {self.sigterm_at_s:.1f} s -> exit {self.statuses[0]}, {rerun}"
        tail = f": {self.last_error}" if not self.ok and self.last_error else ""
        return (
            f"run {self.index}: {what} exit {self.statuses[-1]} in {self.wall_s:.1f} s{kill}"
            f"{'' if self.report else ', no report'}{tail}"
        )


def _main_cmd(config: str, workdir: str, overrides: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tg_jax.main",
        f"--config={config}",
        f"--workdir={workdir}",
        "--config.stage=pipeline",
        *overrides,
    ]


def _run_once(cmd: list[str], log: str, sigterm_after: float | None) -> tuple[int, str]:
    """Runs `cmd` to its end (SIGTERM after `sigterm_after` seconds if given); returns (exit
    status, last stderr line). stdout and stderr go to `log`."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        if sigterm_after is not None:
            try:
                proc.wait(timeout=sigterm_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)
        status = proc.wait()
    with open(log, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return status, (lines[-1] if lines else "")


def soak_run(
    index: int, config: str, root: str, overrides: Sequence[str], sigterm_after: float | None
) -> RunOutcome:
    """Run `index` in a fresh workdir root/run_<index>: the command, and after a SIGTERM the
    same command again (the resume)."""
    workdir = os.path.join(root, f"run_{index}")
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    cmd = _main_cmd(config, workdir, overrides)
    start = time.monotonic()
    statuses, error = [], ""
    status, error = _run_once(cmd, os.path.join(workdir, "soak_0.log"), sigterm_after)
    statuses.append(status)
    if sigterm_after is not None:
        status, error = _run_once(cmd, os.path.join(workdir, "soak_1.log"), None)
        statuses.append(status)
    report = os.path.exists(os.path.join(workdir, "report", "results.json"))
    return RunOutcome(index, statuses, time.monotonic() - start, sigterm_after, report, error)


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m tg_jax.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--config", required=True, help="config file (configs/*.py)")
    parser.add_argument("--workdir", required=True, help="root of the runs' workdirs")
    parser.add_argument("--runs", type=int, default=8, help="runs (default 8)")
    parser.add_argument(
        "--kill_every",
        type=int,
        default=2,
        help="SIGTERM every k-th run (runs k-1, 2k-1, ...); 0 = never",
    )
    parser.add_argument("--busy", type=int, default=1, help="competing busy processes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the SIGTERM moments")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith(("--config.", "--noconfig."))]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if args.runs < 1 or args.kill_every < 0 or args.busy < 0:
        parser.error("--runs must be >= 1, --kill_every and --busy >= 0")
    return args, rest


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parse(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.workdir, exist_ok=True)
    rng = random.Random(args.seed)
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
    outcomes: list[RunOutcome] = []
    try:
        for i in range(args.runs):
            kill = args.kill_every > 0 and i % args.kill_every == args.kill_every - 1
            sigterm_after = None
            if kill and outcomes:  # the first run's wall time sets the range of the moment
                sigterm_after = rng.uniform(0.1, 0.9) * outcomes[0].wall_s
            outcome = soak_run(i, args.config, args.workdir, overrides, sigterm_after)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    ok = sum(o.ok for o in outcomes)
    print(f"soak: {ok}/{len(outcomes)} ok", flush=True)
    return 0 if ok == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
