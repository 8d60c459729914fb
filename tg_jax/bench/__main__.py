"""One benchmark command: figures of tg_jax against references measured in the same run.

    python -m tg_jax.bench --suite quick --out bench.json      # a few minutes on 2 CPU cores
    python -m tg_jax.bench --suite full --out bench_full.json  # the issue's sizes (longer)
    python -m tg_jax.bench --suite quick --workdir ./workdir   # + the main job's wall time

Prints a table and writes JSON ({"suite", "machine", "sections", "figures"}); see
`tg_jax.bench` for what each figure measures.

Huge pages: XLA's CPU runtime maps a fresh temp buffer for every execution and unmaps it after
(about 1.4 GB per mid-size train step), so with 4 KiB pages each step takes ~0.4 M page faults,
which are slow in a VM. glibc's `hugetlb` tunable makes malloc ask for transparent huge pages
(~50x fewer faults; ~10% less CPU time per step measured on the 2-core VM). The command re-runs
itself with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 unless it is set or --no_hugepages is given;
the transformers subprocesses inherit it, so both sides run with the same allocator setting.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

from tg_jax.bench import suites

# Goals and references next to the figures they judge.
GOALS = {
    "sampler/b64/speedup": ">= 5 (vs transformers)",
    "train/mid/mfu": ">= 0.60",
    "train/mid/speedup": "> 1 (vs transformers)",
    "rl/tg_over_grpo": "<= 1.35",
    "rl/tg_over_grpo_10pct": "<= 1.10",
    "kl/chunked_over_naive": "<= 0.10 at T=8192",
    "overlap/async_over_max": "<= 1.15",
    "sandbox/namespace/light/w2/runs_per_s": ">= 10",
}
_TUNABLES, _HUGETLB = "GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"
_SKIP = (
    "/load",
    "/hf_load",
    "/batch",
    "/seq_len",
    "/prompt_len",
    "/new_tokens",
    "/length",
    "/d_model",
    "/vocab",
    "/chunk",
    "/n",
    "/rounds",
)


def _fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def table(result: dict[str, Any]) -> str:
    """The figures as a Markdown table (figure, value, goal, load when measured)."""
    lines = ["| figure | value | goal | load |", "|---|---|---|---|"]
    for section, figures in result["sections"].items():
        if isinstance(figures, dict) and figures.get("status"):
            lines.append(f"| {section} | {figures['status']} | | |")
            continue
        flat = suites.flatten({section: figures})
        for key, value in flat.items():
            if key.endswith(_SKIP):
                continue
            group = key.rsplit("/", 1)[0]
            load = flat.get(f"{group}/load", flat.get(f"{section}/load"))
            if key.endswith(("hf_tok_s", "hf_mfu", "hf_step_s")):
                load = flat.get(f"{group}/hf_load", load)
            load_s = "" if load is None else f"{load:.1f}"
            lines.append(f"| {key} | {_fmt(value)} | {GOALS.get(key, '')} | {load_s} |")
    settings = []
    for section, figures in result["sections"].items():
        for group, v in figures.items() if isinstance(figures, dict) else ():
            if isinstance(v, dict) and "hf_setting" in v:
                settings.append(f"{section}/{group}: {v['hf_setting']}")
    if settings:
        lines.append("")
        lines.append("transformers best settings: " + "; ".join(settings))
    m = result["machine"]
    lines.append(
        f"machine: {m['cpus']} {m['platform']} CPUs, jax {m['jax']}, load average "
        f"{m['load_start']:.1f} at start, {m['load_end']:.1f} at end, "
        f"GLIBC_TUNABLES={m.get('glibc_tunables', '')!r}"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="quick", choices=sorted(suites.SUITES))
    parser.add_argument("--out", default=None, help="JSON output file")
    parser.add_argument("--workdir", default=None, help="a finished main-job workdir (e2e)")
    parser.add_argument("--config", default=suites.DEFAULT_CONFIG, help="the run config file")
    parser.add_argument(
        "--sections",
        default="",
        help="comma-separated subset: sampler,train,rl,kl,overlap,sandbox,e2e (the default), "
        "agentic (asked for by name)",
    )
    parser.add_argument(
        "--engines",
        default="builtin",
        help="agentic: the engines timed beside the lock-step sampler, builtin or builtin,vllm "
        "(vLLM: the .[vllm] extra)",
    )
    parser.add_argument(
        "--engine_min_bucket",
        type=int,
        default=0,
        help="agentic: the engine's smallest rows / page-width bucket (0: its MIN_BUCKET)",
    )
    parser.add_argument(
        "--no_hugepages", action="store_true", help="do not set glibc.malloc.hugetlb=1"
    )
    args = parser.parse_args(argv)
    tunables = os.environ.get(_TUNABLES, "")
    if argv is None and not args.no_hugepages and _HUGETLB not in tunables:
        # glibc reads its tunables at process start: run again with them.
        env = dict(os.environ, **{_TUNABLES: ":".join(t for t in (tunables, _HUGETLB) if t)})
        os.execve(sys.executable, [sys.executable, "-m", "tg_jax.bench", *sys.argv[1:]], env)
    sections = tuple(s for s in args.sections.split(",") if s) or None
    result = suites.run_suite(
        suites.SUITES[args.suite],
        config_path=args.config,
        workdir=args.workdir,
        sections=sections,
        log=lambda s: print(s, flush=True),
        engines=tuple(e for e in args.engines.split(",") if e),
        engine_min_bucket=args.engine_min_bucket,
    )
    result["machine"]["glibc_tunables"] = os.environ.get(_TUNABLES, "")
    print(table(result))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
