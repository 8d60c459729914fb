"""One process of tiny RL runs on simulated CPU devices, alone or under `jax.distributed`.

    python -m tests.multihost_driver WORKDIR --devices 8                        # 1 process
    TG_JAX_DISTRIBUTED=1 TG_JAX_COORDINATOR=localhost:PORT TG_JAX_NUM_PROCESSES=2 \\
      TG_JAX_PROCESS_ID=i python -m tests.multihost_driver WORKDIR --devices 4  # process i
    ... --split 4   # and the same run with the sampler on 4 devices of its own
    ... --engine    # and the same run on the built-in engine

WORKDIR/det: tests/rl_loop_driver.py's config (configs/tiny.py, TG arm) in the deterministic
mode for --steps steps (held-out evaluation at steps 0, 2 and the last), exporting the params
at the last step; process 0 writes det/final_params.npz (every param leaf by path, gathered
from all processes) when it finishes.
With --split N > 0, WORKDIR/split: det's run with the sampler on devices of its own
(sampler_mesh.num_devices N: the last N / P devices of each process), its final params in
split/final_params.npz likewise.
With --engine, WORKDIR/engine: det's run with rl_loop.rollout_engine "builtin" (each process's
engine on its sampler's mesh), its final params in engine/final_params.npz likewise.
With --whole H > 0 the driver runs one run alone, WORKDIR/whole: det's run under the whole-host
split (sampler_mesh.processes H: the last H processes sample, the others train), stopped after
its step STEPS - 1 checkpoint and resumed (the same processes) to the end; run by one process
it is the reference instead, det's run with the sampler on --split devices of its own.
Then, with --async-steps N > 0, WORKDIR/async: a copy of det resumed from its last checkpoint
for N more steps with the sampling thread, without evaluation (the same processes, so the
start-up is paid once).
"""

from __future__ import annotations

import argparse
import os
import shutil


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--async-steps", type=int, default=0)
    parser.add_argument("--split", type=int, default=0)
    parser.add_argument("--engine", action="store_true")
    parser.add_argument("--whole", type=int, default=0)
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    # XLA:CPU's quick settings (tests/compile_settings.py): every process here compiles afresh
    # (several CPU devices) tiny programs that run for moments; all runs compared share them.
    from tests import compile_settings

    devices = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.update(compile_settings.with_quick_flags({"XLA_FLAGS": devices}))

    from tg_jax.tpu import distributed

    distributed.initialize_from_env()  # before any other JAX call

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from tests import rl_loop_driver as driver
    from tg_jax.train import rl

    jax.config.update("jax_numpy_rank_promotion", "raise")
    if os.environ.get("TG_JAX_COMPILATION_CACHE"):
        jax.config.update("jax_compilation_cache_dir", os.environ["TG_JAX_COMPILATION_CACHE"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    def exporter(params, out_dir):  # the whole-host split: every trainer process calls it
        params = jax.tree.map(
            lambda x: x if x.is_fully_addressable else
            multihost_utils.process_allgather(x, tiled=True), params,
        )  # fmt: skip
        if jax.process_index() == 0:
            os.makedirs(out_dir)
            np.savez(os.path.join(out_dir, "params.npz"), **driver.flat_params(params))

    def run(name, async_sampling, steps, split=0, engine="lockstep", whole=0, stop_after=None):
        workdir = os.path.join(args.workdir, name)
        config = driver.make_config("tg", async_sampling, steps)
        config.sampler_mesh.num_devices = split
        config.sampler_mesh.processes = whole
        config.rl_loop.rollout_engine = engine
        config.rl_loop.export_every = steps
        if async_sampling:  # only shows that it runs: no evaluation (fewer compilations)
            config.rl_loop.eval_every = 0
        result = rl.run_rl(
            config, workdir, driver.initial_params(config), arm_name="tg", seed=0,
            sources=driver.make_sources(), exporter=exporter, stop_after=stop_after,
        )  # fmt: skip
        params = multihost_utils.process_allgather(result.state.params, tiled=True)
        if result.finished and jax.process_index() == 0:
            np.savez(os.path.join(workdir, "final_params.npz"), **driver.flat_params(params))
        print(
            f"driver: {name} process {jax.process_index()}/{jax.process_count()} step "
            f"{result.step} finished {result.finished}",
            flush=True,
        )

    if args.whole and jax.process_count() > 1:
        run("whole", False, args.steps, whole=args.whole, stop_after=args.steps - 1)
        run("whole", False, args.steps, whole=args.whole)
        return
    if args.whole:  # the reference of the whole-host split
        run("whole", False, args.steps, split=args.split)
        return
    run("det", False, args.steps)
    if args.split > 0:  # the sampler on devices of its own (the last split / P of each process)
        run("split", False, args.steps, split=args.split)
    if args.engine:
        run("engine", False, args.steps, engine="builtin")
    if args.async_steps > 0:
        if jax.process_index() == 0:
            shutil.copytree(os.path.join(args.workdir, "det"), os.path.join(args.workdir, "async"))
        multihost_utils.sync_global_devices("async workdir copied")
        run("async", True, args.steps + args.async_steps)


if __name__ == "__main__":
    main()
