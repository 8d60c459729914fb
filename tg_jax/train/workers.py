"""The pipeline's RL runs in parallel worker processes (`pipeline.workers` > 1).

    run_parallel(config, workdir, jobs, workers)

The embedded default's model is too small for XLA to keep the cores of a small machine busy
with one run (its sampler steps are short, serial programs), so independent runs (arm x
training seed) train side by side, one process each, at most `workers` at a time. Each worker
does exactly what the sequential pipeline does for its run (`pipeline.train_and_evaluate`:
RL, export, held-out evaluation, each cached in the run's directory), so afterwards the
pipeline's own loop finds every run finished and reads the results back; the results do not
depend on the number of workers (tests/test_workers.py compares them).

A worker is a fresh interpreter (`python -c`, not a fork of this JAX process) that reads its
job from `runs/<run>/worker_job.pkl` and writes its output to `runs/<run>/worker.log`; this
process prints one line per run started or finished, with the count done and an ETA.

Failures and preemption lose nothing: a SIGTERM to this process is passed on to the workers,
which checkpoint and exit (as the sequential pipeline does); a worker that fails stops the
others the same way and raises `WorkerError` with the tail of its log. Rerunning the command
resumes every unfinished run.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from tg_jax import checkpointing, paths

JOB_FILE, LOG_FILE = "worker_job.pkl", "worker.log"
PREEMPTED_EXIT = 75  # a worker that stopped on a preemption request, its checkpoint saved
_POLL_S = 0.5


class WorkerError(RuntimeError):
    """An RL run failed in its worker process (its log's tail is in the message)."""


def _finished(config: Any, workdir: str, arm: str, seed: int) -> bool:
    """Whether the run's held-out evaluation exists (the last of its cached parts)."""
    from tg_jax.evaluation import heldout  # noqa: PLC0415
    from tg_jax.train import pipeline  # noqa: PLC0415

    return (paths.as_path(pipeline.run_dir_of(workdir, arm, seed)) / heldout.HELDOUT_FILE).exists()


def _log_tail(path: str, n: int = 25) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _start(config: Any, workdir: str, arm: str, seed: int) -> tuple[subprocess.Popen, str]:
    """Starts the worker process of one run; returns it and its log path."""
    import jax  # noqa: PLC0415
    from absl import logging  # noqa: PLC0415

    from tg_jax.train import pipeline  # noqa: PLC0415

    run_dir = pipeline.run_dir_of(workdir, arm, seed)
    os.makedirs(run_dir, exist_ok=True)
    job = {"config": config, "workdir": workdir, "arm": arm, "seed": int(seed),
           "verbosity": logging.get_verbosity()}  # fmt: skip
    with open(os.path.join(run_dir, JOB_FILE), "wb") as f:
        pickle.dump(job, f)
    env = dict(os.environ)
    cache = jax.config.jax_compilation_cache_dir
    if cache:  # the same persistent compilation cache as this process
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    log_path = os.path.join(run_dir, LOG_FILE)
    code = f"from tg_jax.train import workers; workers.worker_main({run_dir!r})"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=log, env=env)
    return proc, log_path


def worker_main(run_dir: str) -> None:
    """A worker process: the job in `run_dir/worker_job.pkl`, then exit 0, or PREEMPTED_EXIT
    after a preemption request (its checkpoint saved)."""
    from absl import logging  # noqa: PLC0415

    from tg_jax.train import data_stage, pipeline  # noqa: PLC0415

    with open(os.path.join(run_dir, JOB_FILE), "rb") as f:
        job = pickle.load(f)
    logging.set_verbosity(job["verbosity"])
    config, workdir, arm, seed = job["config"], job["workdir"], job["arm"], job["seed"]
    checkpointing.install_sigterm_handler()  # before any work: SIGTERM saves, never kills
    sources = data_stage.prepare_tasks(config, workdir)
    md = pipeline.model_dir_of(config, workdir)
    try:
        pipeline.train_and_evaluate(
            pipeline.arm_config(config, arm), workdir, arm, seed,
            base_params=pipeline.base_params_of(config, md), md=md, sources=sources,
            eval_tasks=data_stage.load_tasks(sources, "heldout", config.eval.num_tasks),
        )  # fmt: skip
    except checkpointing.Preempted:
        sys.exit(PREEMPTED_EXIT)
    sys.exit(PREEMPTED_EXIT if checkpointing.preemption_requested() else 0)


def _stop(procs: dict[str, tuple[subprocess.Popen, str, float]]) -> None:
    """SIGTERM to every running worker (each saves its checkpoint), then waits for them."""
    for proc, _, _ in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc, _, _ in procs.values():
        proc.wait()


def _preempted(stage: str, workdir: str) -> checkpointing.Preempted:
    from tg_jax.train import pipeline  # noqa: PLC0415

    return pipeline._preempted(stage, workdir)  # noqa: SLF001 (one message for both paths)


def _eta(durations: list[float], left: int, running: int, workers: int) -> str:
    if not durations:
        return ""
    mean = sum(durations) / len(durations)
    return f", eta ~{mean * (left + running) / workers / 60:.0f} min"


def run_parallel(config: Any, workdir: str, jobs: Sequence[tuple[str, int]], workers: int) -> float:
    """Trains and evaluates the unfinished runs of `jobs` ((arm, seed) pairs), at most
    `workers` at a time, each in its own process. Returns the wall time in seconds.

    Raises:
      checkpointing.Preempted: SIGTERM reached this process; every worker saved and stopped.
      WorkerError: a worker failed (the others were stopped the same way, nothing lost).
    """
    import jax  # noqa: PLC0415

    if jax.process_count() > 1:
        raise ValueError(
            "pipeline.workers > 1 runs each RL run in a process of its own on this host; a "
            "multi-host job (jax.process_count() > 1) runs them in turn: set pipeline.workers=1"
        )
    todo = [(a, int(s)) for a, s in jobs if not _finished(config, workdir, a, int(s))]
    if not todo:
        return 0.0
    checkpointing.install_sigterm_handler()
    print(f"pipeline: {len(todo)} RL runs in {workers} worker processes "
          f"(logs: runs/<run>/{LOG_FILE})", flush=True)  # fmt: skip
    start, durations = time.perf_counter(), []
    running: dict[str, tuple[subprocess.Popen, str, float]] = {}
    try:
        while todo or running:
            while todo and len(running) < workers:
                arm, seed = todo.pop(0)
                proc, log_path = _start(config, workdir, arm, seed)
                running[f"{arm}_seed{seed}"] = (proc, log_path, time.perf_counter())
                print(f"pipeline: started {arm}_seed{seed}", flush=True)
            if checkpointing.preemption_requested():
                _stop(running)
                raise _preempted("the RL runs (workers)", workdir)
            for name, (proc, log_path, t0) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                del running[name]
                if rc != 0:
                    _stop(running)
                    if rc in (PREEMPTED_EXIT, -signal.SIGTERM):
                        raise _preempted(f"RL run {name} (worker)", workdir)
                    raise WorkerError(
                        f"RL run {name} failed in its worker process (exit {rc}); the other "
                        f"runs were stopped with their checkpoints saved; rerun to resume. "
                        f"Last lines of {log_path}:\n{_log_tail(log_path)}"
                    )
                durations.append(time.perf_counter() - t0)
                done = len(jobs) - len(todo) - len(running)
                eta = _eta(durations, len(todo), len(running), workers)
                print(f"pipeline: finished {name} in {durations[-1] / 60:.1f} min "
                      f"({done}/{len(jobs)} runs done{eta})", flush=True)  # fmt: skip
            time.sleep(_POLL_S)
    except BaseException:
        _stop(running)
        raise
    return time.perf_counter() - start
