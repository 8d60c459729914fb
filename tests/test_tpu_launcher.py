"""The TPU launcher's rules, as pure functions and with a fake gcloud (no pods started): what
it retries, the dirty-tree refusal, each worker's environment, the install script, the
dry run's commands."""

import os
import shlex
import subprocess
import types

import pytest

from tg_jax.tpu import launch, local_pod, pod_commands, pod_outcome, pod_setup, pod_slice

ARGS = [
    "--name=tg-30b", "--zone=us-east5-a", "--project=proj", "--topology=v5p:2x4x4",
    "--config=configs/qwen3_coder_30b_a3b_tg.py", "--workdir=gs://bucket/runs/tg",
]  # fmt: skip
WHERE = "--zone=us-east5-a --project=proj"
HEAD = "a" * 40
CLEAN = types.SimpleNamespace(git_status=lambda: (HEAD, ""), working_tree=lambda: "unused")


def _marks(step: str, *codes: int) -> str:
    return "".join(f"[tg_jax-exit] {step} {c} host-w{i}\n" for i, c in enumerate(codes))


def test_accelerator_types_and_workers():
    assert pod_slice.accelerator_type("v5p:2x4x4") == "v5p-64"  # 32 chips, 2 cores each
    assert pod_slice.accelerator_type("v5p:2x2x1") == "v5p-8"
    assert pod_slice.accelerator_type("v4:2x2x4") == "v4-32"
    assert pod_slice.accelerator_type("v5e:4x4") == "v5litepod-16"
    assert pod_slice.accelerator_type("v6e:2x2") == "v6e-4"
    with pytest.raises(ValueError, match="v5p:2x4x4"):
        pod_slice.accelerator_type("tpu:8")
    # 4 chips per host; v5e / v6e slices of up to 8 chips are one host.
    assert pod_slice.worker_count("v5p:2x4x4") == 8
    assert pod_slice.worker_count("v5p:4x4x4") == 16
    assert pod_slice.worker_count("v5p:2x2x1") == 1
    assert pod_slice.worker_count("v4:2x2x4") == 4
    assert pod_slice.worker_count("v5e:4x4") == 4
    assert pod_slice.worker_count("v6e:2x4") == 1


def test_exit_statuses_match_the_trainer_and_what_each_means():
    from tg_jax import checkpointing, cli

    assert pod_outcome.EXIT_RULES[cli.USAGE_ERROR][0] == "stop"
    assert pod_outcome.EXIT_RULES[cli.GATE_ERROR][0] == "stop"
    assert pod_outcome.EXIT_RULES[cli.RUN_ERROR][0] == "stop"
    assert pod_outcome.PREEMPTED == checkpointing.PREEMPTED_EXIT_CODE == 143
    actions = {c: pod_outcome.exit_rule(c)[0] for c in (0, 1, 2, 3, 4, 137, 143, 255, -9)}
    assert actions == {0: "done", 1: "retry", 2: "stop", 3: "stop", 4: "stop", 137: "retry",
                       143: "retry", 255: "retry", -9: "retry"}  # fmt: skip
    assert (
        "signal 9" in pod_outcome.exit_rule(137)[1] and "signal 9" in pod_outcome.exit_rule(-9)[1]
    )
    assert "preempted" in pod_outcome.exit_rule(143)[1]


def test_outcome_reads_every_workers_status_not_gclouds():
    # Every worker printed 0: done, whatever gcloud's own status.
    assert pod_outcome.outcome(0, _marks("run", 0, 0, 0, 0), 4, "run").action == "done"
    # gcloud can exit 0 when a worker failed (older releases ignore the workers' statuses):
    # the marks decide. Worker 2 preempted, worker 3 crashed as its peer left: a preemption.
    o = pod_outcome.outcome(0, _marks("run", 0, 0, 143, 1), 4, "run")
    assert (o.action, o.code) == ("retry", 143)
    # A worker that printed nothing (its ssh dropped, its VM vanished): retried.
    o = pod_outcome.outcome(0, _marks("run", 0, 0, 0), 4, "run")
    assert (o.action, o.why) == ("retry", "3 of 4 workers reported an exit status (ssh lost?)")
    assert pod_outcome.outcome(255, "", 4, "run").code == 255
    # Another step's marks do not count for this one.
    assert pod_outcome.outcome(0, _marks("install", 0, 0, 0, 0), 4, "run").action == "retry"


def test_outcome_stops_on_a_config_error_a_gate_and_a_fit_failure_with_the_error_line():
    out = "step 1\nerror: invalid config: rl_loop.epochs=0 must be >= 1\n" + _marks("run", 2, 2)
    o = pod_outcome.outcome(2, out, 2, "run")
    assert (o.action, o.code) == ("stop", 2)
    assert o.error == "error: invalid config: rl_loop.epochs=0 must be >= 1"
    gate = "error: the base model failed its gates: pass@1 0.10 < 0.30\n" + _marks("run", 3, 143)
    o = pod_outcome.outcome(3, gate, 2, "run")
    assert (o.action, o.code) == ("stop", 3)
    # The fit check refuses with exit 2 through tg_jax.main; a traceback (exit 1) also stops.
    fit = ("tg_jax.tpu.fit.FitError: the config does not fit its devices' memory: train\n"
           + _marks("run", 1, 1))  # fmt: skip
    o = pod_outcome.outcome(1, fit, 2, "run")
    assert (o.action, o.code) == ("stop", 2) and "fit check" in o.why


class FakeGcloud:
    """A runner answering like gcloud: `states` for describe, `runs` (codes per worker, or a
    callable) for the run step, `installs` likewise for the install step; logs each verb."""

    def __init__(self, states, runs, installs=None, n_workers=8, errors=()):
        self.states, self.runs = iter(states), iter(runs)
        self.installs = iter(installs or [])
        self.n_workers, self.errors, self.log = n_workers, dict(errors), []

    def __call__(self, cmd):
        verb = "archive" if cmd[1] == "archive" else cmd[4]
        if verb == "ssh":
            verb = cmd[-1].rsplit("[tg_jax-exit] ", 1)[1].split()[0]
        self.log.append(verb)
        if verb == "describe":
            return 0, next(self.states) + "\n"
        if verb in ("run", "install"):
            codes = next(self.runs if verb == "run" else self.installs, 0)
            codes = codes if isinstance(codes, tuple) else (codes,) * self.n_workers
            err = self.errors.get(max(codes), "")
            return max(codes), (f"{err}\n" if err else "") + _marks(verb, *codes)
        return 0, ""


def _launch(gcloud, *, clock=None, **kw):
    job, _ = launch.parse_args(ARGS)
    sleeps = []
    kw = {"max_restarts": 5, "poll_s": 0, "sleep": sleeps.append, **kw}
    if clock is not None:
        kw["clock"] = clock
    return launch.launch(job, gcloud, **kw), sleeps


def test_preemption_recreates_reinstalls_and_resumes():
    gcloud = FakeGcloud(["READY", "PREEMPTED", "CREATING", "READY"], [(0,) * 7 + (143,), 0])
    rc, _ = _launch(gcloud)
    assert rc == 0
    assert gcloud.log == [
        "describe", "archive", "scp", "install", "run",  # existing slice: install, run (dies)
        "describe", "delete", "create", "describe", "describe",  # preempted: recreate, wait
        "archive", "scp", "install", "run",  # reinstall on the new slice, resume
    ]  # fmt: skip


@pytest.mark.parametrize("code", [2, 3, 4])
def test_a_config_error_a_gate_or_a_run_fault_stops_at_once_with_the_error_line(code, capsys):
    line = f"error: what went wrong (exit {code})"
    gcloud = FakeGcloud(["READY"], [code, 0], errors={code: line})
    rc, sleeps = _launch(gcloud)
    assert rc == code and sleeps == []
    assert gcloud.log == ["describe", "archive", "scp", "install", "run"]  # no rerun
    out = capsys.readouterr().out
    assert f"[launch] {line}\n" in out and "stopping" in out


def test_quick_crashes_stop_after_max_quick_failures_slow_ones_are_retried(capsys):
    # Each run crashes (exit 1) a minute after its start: the third in a row stops it.
    t = iter(range(0, 10**6, 60))
    gcloud = FakeGcloud(["READY"] * 10, [1] * 10)
    rc, _ = _launch(gcloud, clock=lambda: next(t), max_quick_failures=3)
    assert rc == 1 and gcloud.log.count("run") == 3
    assert "3 failures in a row" in capsys.readouterr().out
    # Crashes two hours into each run are a flaky machine's: retried until max_restarts.
    t = iter(range(0, 10**6, 7200))
    gcloud = FakeGcloud(["READY"] * 10, [1] * 10)
    rc, _ = _launch(gcloud, clock=lambda: next(t), max_restarts=4, max_quick_failures=3)
    assert rc == 1 and gcloud.log.count("run") == 5
    # Preemptions never count as quick failures.
    gcloud = FakeGcloud(["READY"] * 10, [143] * 4 + [0])
    rc, _ = _launch(gcloud, clock=lambda: 0.0, max_quick_failures=2)
    assert rc == 0 and gcloud.log.count("run") == 5


def test_install_failures_missing_interpreter_stops_a_download_is_retried():
    gcloud = FakeGcloud(["READY"], [], installs=[2], errors={2: "error: no Python 3.12.16"})
    rc, _ = _launch(gcloud)
    assert rc == 2 and "run" not in gcloud.log
    gcloud = FakeGcloud(["READY", "READY"], [0], installs=[1, 0])
    rc, _ = _launch(gcloud)
    assert rc == 0 and gcloud.log.count("install") == 2 and gcloud.log.count("run") == 1


def test_gives_up_after_max_restarts():
    gcloud = FakeGcloud(["READY"] * 10, [143] * 10)
    rc, _ = _launch(gcloud, max_restarts=2)
    assert rc == 1 and gcloud.log.count("run") == 3


def test_dirty_tree_is_refused_unless_allow_dirty(capsys):
    porcelain = " M configs/x.py\n?? configs/new.py\nD  old.py\n"
    assert pod_setup.dirty_paths(porcelain) == ["configs/x.py", "configs/new.py", "old.py"]
    assert pod_setup.dirty_refusal("", allow_dirty=False) is None
    assert pod_setup.dirty_refusal(porcelain, allow_dirty=True) is None
    refusal = pod_setup.dirty_refusal(porcelain, allow_dirty=False)
    assert "configs/x.py, configs/new.py, old.py" in refusal and "--allow-dirty" in refusal

    dirty = types.SimpleNamespace(
        git_status=lambda: (HEAD, porcelain), working_tree=lambda: "f" * 40
    )
    assert launch.main(ARGS, git=dirty) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: the git tree has uncommitted changes") and "gcloud" not in out
    # --allow-dirty ships the working tree's git tree and lists what is uncommitted.
    assert launch.main([*ARGS, "--allow-dirty", "--dry-run"], git=dirty) == 0
    out = capsys.readouterr().out
    assert f"--output=/tmp/tg_jax_code.tar.gz {'f' * 40}\n" in out
    assert "3 uncommitted paths: configs/x.py, configs/new.py, old.py" in out
    # A dry run of a dirty tree says the real launch stops, and shows the rest.
    assert launch.main([*ARGS, "--dry-run"], git=dirty) == 0
    out = capsys.readouterr().out
    assert "# a real launch stops here: error: the git tree" in out and f" {HEAD}\n" in out

    # Outside a git repository: one error line too.
    def no_repo():
        raise RuntimeError("git rev-parse HEAD failed: fatal: not a git repository")

    assert launch.main(ARGS, git=types.SimpleNamespace(git_status=no_repo)) == 2
    assert capsys.readouterr().err == (
        "error: cannot tell which code to ship: git rev-parse HEAD failed: fatal: not a git "
        "repository\n"
    )


def test_working_tree_holds_uncommitted_and_untracked_files_and_leaves_the_repo(tmp_path):
    def git(*a):
        cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a]
        return subprocess.run(cmd, cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "config.py").write_text("steps = 1\n")
    (tmp_path / ".gitignore").write_text("*.log\n")
    git("add", "-A")
    git("commit", "-qm", "c")
    (tmp_path / "config.py").write_text("steps = 2\n")
    (tmp_path / "new.py").write_text("x = 1\n")
    (tmp_path / "run.log").write_text("ignored\n")
    before = git("status", "--porcelain")
    tree = pod_setup.working_tree(cwd=str(tmp_path))
    assert git("status", "--porcelain") == before == " M config.py\n?? new.py\n"
    assert git("ls-tree", "--name-only", tree).split() == [".gitignore", "config.py", "new.py"]
    assert git("show", f"{tree}:config.py") == "steps = 2\n"
    head, porcelain = pod_setup.git_status(cwd=str(tmp_path))
    assert head == git("rev-parse", "HEAD").strip() and porcelain == before


def test_each_pod_worker_gets_its_own_transfer_address():
    job, _ = launch.parse_args([*ARGS, "--transfer-port=9001"])
    env = pod_commands.pod_worker_env(job)
    assert env["TG_JAX_DISTRIBUTED"] == "1"
    # Evaluated by bash on a worker whose addresses are 10.1.2.3 and 10.9.9.9.
    fake = 'hostname() { echo "10.1.2.3 10.9.9.9 "; }; '
    got = subprocess.run(["bash", "-c", fake + f"echo {env['TG_JAX_TRANSFER_ADDRESS']}"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert got == "10.1.2.3:9001\n"
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    assert f"export {exports} && .venv/bin/python -m tg_jax.main" in _remote(
        pod_commands.run_command(job))[2]  # fmt: skip


def test_local_pod_workers_environments():
    base = {"HOME": "/h", "XLA_FLAGS": "--a=1"}
    envs = [local_pod.local_worker_env(base, i, 2, 4, 1234, 5000 + i) for i in range(2)]
    assert envs[1] == {
        "HOME": "/h", "TG_JAX_DISTRIBUTED": "1", "TG_JAX_COORDINATOR": "localhost:1234",
        "TG_JAX_NUM_PROCESSES": "2", "TG_JAX_PROCESS_ID": "1",
        "TG_JAX_TRANSFER_ADDRESS": "127.0.0.1:5001", "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=4", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    assert envs[0]["TG_JAX_TRANSFER_ADDRESS"] == "127.0.0.1:5000"
    assert len(set(local_pod._free_ports(4))) == 4


def _dry_run(capsys, *extra):
    """The dry run's output, and the commands it printed before the install script (a
    command's quoted argument can span lines)."""
    assert launch.main([*ARGS, "--dry-run", *extra], git=CLEAN) == 0
    out = capsys.readouterr().out
    cmds, pending = [], ""
    for line in out.split("\n# the install script")[0].splitlines():
        if not pending and not line.startswith(("gcloud", "git")):
            continue
        pending += line if not pending else "\n" + line
        try:
            cmds.append(shlex.split(pending))
        except ValueError:  # an open quote: the command goes on
            continue
        pending = ""
    return out, cmds


def _remote(ssh: list[str]) -> list[str]:
    """The words of an ssh command's remote command, `;` apart: [bash, -c, BODY, ;, echo...]."""
    lexer = shlex.shlex(ssh[-1].removeprefix("--command="), posix=True, punctuation_chars=";")
    lexer.whitespace_split = True
    return list(lexer)


def test_dry_run_prints_the_gcloud_commands(capsys):
    out, cmds = _dry_run(capsys, "--spot", "--", "--config.rl_loop.steps=200")
    assert shlex.join(cmds[0]) == (
        f"gcloud compute tpus tpu-vm describe tg-30b {WHERE} '--format=value(state)'"
    )
    assert shlex.join(cmds[1]) == (
        f"gcloud compute tpus tpu-vm create tg-30b {WHERE} --accelerator-type=v5p-64 "
        "--version=v2-alpha-tpuv5 --spot"
    )
    # The commit resolved once, not HEAD (a reinstall ships the same code).
    assert cmds[3] == ["git", "archive", "--format=tar.gz", "--output=/tmp/tg_jax_code.tar.gz",
                       HEAD]  # fmt: skip
    assert cmds[4][:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "/tmp/tg_jax_code.tar.gz"]
    assert "--worker=all" in cmds[4] and "--worker=all" in cmds[5]
    run = cmds[6]
    assert run[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tg-30b"]
    assert "--worker=all" in run
    remote = _remote(run)[2]
    assert ".venv/bin/python -m tg_jax.main" in remote and "TG_JAX_DISTRIBUTED=1" in remote
    assert "--config=configs/qwen3_coder_30b_a3b_tg.py --workdir=gs://bucket/runs/tg" in remote
    assert remote.split(" 2>&1")[0].endswith("--config.rl_loop.steps=200")
    last = out.rstrip().splitlines()[-2]
    assert last == f"gcloud compute tpus tpu-vm delete tg-30b {WHERE} --quiet"


def test_dry_run_prints_the_install_script_that_runs(capsys):
    """One source of truth: the script the dry run prints is the install step's own."""
    out, cmds = _dry_run(capsys, "--vllm")
    install = _remote(cmds[5])
    assert install[:2] == ["bash", "-c"] and install[3] == ";"
    printed = out.split("(bash -c, in the install step above):\n")[1].split("\n# after")[0]
    assert install[2] == printed
    assert f"uv python install --no-bin {pod_setup.PYTHON}" in printed
    assert '-c constraints-tpu.txt -e ".[tpu]" "jax[tpu]==0.11.2" "flax==0.12.10"' in printed
    assert '"vllm-tpu==0.32.0"' in printed
    _, cmds = _dry_run(capsys)
    assert "vllm-tpu" not in cmds[5][-1]


def test_dry_run_queued_resource_and_checkpoint(capsys):
    out, _ = _dry_run(capsys, "--queued", "--hf-checkpoint=gs://bucket/qwen")
    assert (
        f"gcloud compute tpus queued-resources create tg-30b --node-id=tg-30b {WHERE} "
        "--accelerator-type=v5p-64 --runtime-version=v2-alpha-tpuv5\n"
    ) in out
    assert "'--format=value(state.state)'" in out
    assert "gcloud storage cp -r gs://bucket/qwen ~/hf_checkpoint" in out
    # ... and the run reads it: the copied directory is the model.
    assert '--config.model.hf_checkpoint="$HOME/hf_checkpoint"' in out
    assert f"queued-resources delete tg-30b {WHERE} --force --quiet" in out


def test_workdir_must_be_on_gcs():
    with pytest.raises(SystemExit):
        launch.parse_args([a if "workdir" not in a else "--workdir=/tmp/x" for a in ARGS])


def _run_install(tmp_path, python):
    """The install script, run by bash in a fresh home with a tiny code archive."""
    home = tmp_path / "home"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "setup.py").write_text("")
    home.mkdir()
    subprocess.run(["tar", "czf", str(home / "code.tar.gz"), "-C", str(tmp_path / "code"), "."],
                   check=True)  # fmt: skip
    script = pod_setup.install_script("~/tg_jax", "code.tar.gz", python=python)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    return subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)


def test_a_missing_or_wrong_interpreter_is_one_error_line_exit_2(tmp_path):
    proc = _run_install(tmp_path, "/no/such/python3.12")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: no Python /no/such/python3.12 on "
                                                f"{os.uname().nodename}"]  # fmt: skip
    # An interpreter of another version (a stand-in that answers like Python 3.10).
    fake = tmp_path / "python3.10"
    fake.write_text('#!/bin/sh\n[ "$1" = -V ] && echo "Python 3.10.12" && exit 0\nexit 1\n')
    fake.chmod(0o755)
    proc = _run_install(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, str(fake))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {fake} is Python 3.10.12, not Python 3.12"
    assert not (tmp_path / "x" / "home" / "tg_jax" / ".venv").exists()  # stopped before it
