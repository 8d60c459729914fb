"""Multi-host correctness: 2 processes x 4 CPU devices under `jax.distributed` == 1 x 8.

The runs are subprocesses of tests/multihost_driver.py, all three started at once: a reference
process with 8 devices, and two processes with 4 devices each that join through
`jax.distributed.initialize` on a free localhost port (TG_JAX_DISTRIBUTED=1 and friends, as
tg_jax.main does; gloo runs the CPU collectives). Each runs 2 deterministic TG steps of the
tiny config, then the two-process pair resumes its run from the last checkpoint for 1 more step
with the sampling thread. Every process is killed if the test fails or a run exceeds its time
limit.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from tests import rl_loop_driver as driver
from tg_jax import multihost
from tg_jax.envs.hints import FeedbackRates
from tg_jax.metrics import read_metrics, read_rl_summary
from tg_jax.models import ModelConfig, Transformer
from tg_jax.sampling.loop import RolloutGroup
from tg_jax.sampling.sampler import Sampler
from tg_jax.train import rl, rl_rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, ASYNC_STEPS = 2, 1
SPLIT = 4  # the split runs' sampler devices: the last 2 of each process, 4 of one
TIMEOUT_S = 600  # all runs together; about 3-4 min on 2 busy cores
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(
    workdir, devices: int, log: str, env=None, async_steps: int = 0, split: int = 0
) -> subprocess.Popen:
    env = dict(os.environ, **(env or {}))
    env.pop("XLA_FLAGS", None)  # the driver sets its own device count
    cmd = [sys.executable, "-m", "tests.multihost_driver", str(workdir), "--devices",
           str(devices), "--steps", str(STEPS), "--async-steps", str(async_steps),
           "--split", str(split), "--engine"]  # fmt: skip
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_all(procs: dict[str, subprocess.Popen], logs: dict[str, str], timeout_s: float):
    """Waits for every process; on a failure or the deadline kills them all and fails."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs.values()):
            failed = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        _kill(procs)
    bad = {n: p.returncode for n, p in procs.items() if p.returncode != 0}
    if bad:
        tails = "\n".join(f"--- {n}:\n{_tail(logs[n])}" for n in bad)
        pytest.fail(f"runs failed or timed out after {timeout_s} s: {bad}\n{tails}")


def _kill(procs: dict[str, subprocess.Popen]) -> None:
    """SIGKILLs every process still running (and its process group), then reaps it."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _tail(path: str, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"ref": 1 x 8 workdir, "mh": 2 x 4 workdir}, all runs finished."""
    base = tmp_path_factory.mktemp("multihost")
    ref, mh = base / "ref", base / "mh"
    port = _free_port()
    logs = {"ref": f"{ref}.log", "p0": f"{mh}.0.log", "p1": f"{mh}.1.log"}
    procs = {}
    try:
        procs["ref"] = _start(ref, 8, logs["ref"], split=SPLIT)
        for i in range(2):
            env = {
                "TG_JAX_DISTRIBUTED": "1", "TG_JAX_COORDINATOR": f"localhost:{port}",
                "TG_JAX_NUM_PROCESSES": "2", "TG_JAX_PROCESS_ID": str(i),
            }  # fmt: skip
            procs[f"p{i}"] = _start(mh, 4, logs[f"p{i}"], env, async_steps=ASYNC_STEPS)
    except BaseException:
        _kill(procs)
        raise
    _wait_all(procs, logs, TIMEOUT_S)
    return {"ref": ref, "mh": mh, "logs": logs}


def _train_and_eval(workdir):
    """{(stage, step): metrics} of the train and eval stages (the self-tests' row, stage
    "selftest", is written by a run that runs them: not under the whole-host split)."""
    rows = read_metrics(workdir)
    return {(r["stage"], r["step"]): r for r in rows if r["stage"] in ("train", "eval")}


@pytest.mark.multiprocess
def test_two_processes_equal_one(runs):
    ref, mh = runs["ref"] / "det", runs["mh"] / "det"
    a, b = np.load(ref / "final_params.npz"), np.load(mh / "final_params.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=TOL, atol=TOL, err_msg=k)

    # One writer: each (stage, step) once in metrics.jsonl; the same records and values.
    recs = read_metrics(mh)
    assert len(recs) == len({(r["stage"], r["step"]) for r in recs})
    ma, mb = _train_and_eval(ref), _train_and_eval(mh)
    assert sorted(ma) == sorted(mb)
    assert [s for st, s in sorted(ma) if st == "train"] == list(range(1, STEPS + 1))
    assert any(st == "eval" for st, _ in ma)
    for step in range(1, STEPS + 1):  # every step really moved the params
        train = ma[("train", step)]
        assert train["grad_norm"] > 0 and train["update_skipped"] == 0 and train["lr"] > 0
    for key, ra in ma.items():
        rb = mb[key]
        names = {n for n in ra if n != "time" and not n.startswith("time/")}
        assert names == {n for n in rb if n != "time" and not n.startswith("time/")}, key
        for n in names:
            if isinstance(ra[n], str):
                assert ra[n] == rb[n], (key, n)
            else:
                assert rb[n] == pytest.approx(ra[n], rel=TOL, abs=TOL), (key, n)
    sa, sb = read_rl_summary(str(ref)), read_rl_summary(str(mh))
    assert len(sb["sessions"]) == 1 and sb["finished"]
    for k in ("sampled_tokens", "teacher_tokens", "teacher_forward_flops"):
        assert sb["costs"][k] == sa["costs"][k], k
    assert sa["costs"]["teacher_forward_flops"] > 0  # TG really ran a teacher


@pytest.mark.multiprocess
def test_a_sampler_on_its_own_devices_equals_the_colocated_run(runs):
    """sampler_mesh.num_devices 4: one process samples on its last 4 devices and trains on its
    first 4, and ends with the colocated run's params; it publishes no weights to itself. The
    same layout on 2 processes x 4 (each samples on its last 2) equals 1 x 8 in
    tests/test_gcs.py's pod, through the launcher, every weight sync logged."""
    ref = runs["ref"]
    a, b = np.load(ref / "split" / "final_params.npz"), np.load(ref / "det" / "final_params.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=TOL, atol=TOL, err_msg=k)
    train = [r for r in read_metrics(ref / "split") if r["stage"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert not any("time/publish_s" in r for r in train)  # one process


@pytest.mark.multiprocess
def test_the_builtin_engine_on_each_process_equals_one_process(runs):
    """rl_loop.rollout_engine "builtin": each of 2 processes plays its share of the groups on
    an engine over its own 4 devices (`Engine(mesh)`), the single process on one engine over 8;
    the same final params and metrics; every step's rollouts came from the engine."""
    ref, mh = runs["ref"] / "engine", runs["mh"] / "engine"
    a, b = np.load(ref / "final_params.npz"), np.load(mh / "final_params.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=TOL, atol=TOL, err_msg=k)
    ma, mb = _train_and_eval(ref), _train_and_eval(mh)
    assert sorted(ma) == sorted(mb)
    # Tokens prefilled depend on which prompts one engine saw (shared pages), not the rollouts;
    # seconds (time/*, *_s) on the machine.
    own = {"time", "rollout/prefill_tokens"}
    for key, ra in ma.items():
        for n in {n for n in ra if n not in own and not n.startswith("time/")}:
            if n.endswith("_s"):
                continue
            if not isinstance(ra[n], str):
                assert mb[key][n] == pytest.approx(ra[n], rel=TOL, abs=TOL), (key, n)
    train = [ma[("train", s)] for s in range(1, STEPS + 1)]
    assert all(r["grad_norm"] > 0 for r in train)
    assert f"engine process 1/2 step {STEPS} finished True" in _tail(runs["logs"]["p1"])


@pytest.mark.multiprocess
def test_the_whole_host_split_equals_one_process(tmp_path):
    """sampler_mesh.processes 2 on 4 processes x 2 devices: processes 0 and 1 train (one
    trainer mesh of 4), 2 and 3 sample on all their devices; the run stops after its step 2
    checkpoint and resumes. One process x 8 with the sampler on its last 4 devices trains the
    same: final params within TOL, every metric of every step and evaluation alike."""
    port, procs, logs = _free_port(), {}, {}

    def start(name, devices, *env_args):
        env = dict(os.environ, **dict(env_args))
        env.pop("XLA_FLAGS", None)
        logs[name] = str(tmp_path / f"{name}.log")
        workdir = tmp_path / ("ref" if name == "ref" else "pod")
        cmd = [sys.executable, "-m", "tests.multihost_driver", str(workdir), "--devices",
               str(devices), "--steps", str(STEPS), "--whole", "2", "--split", "4"]  # fmt: skip
        with open(logs[name], "w") as out:
            procs[name] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    try:
        start("ref", 8)
        for i in range(4):
            start(
                f"p{i}", 2, ("TG_JAX_DISTRIBUTED", "1"), ("TG_JAX_NUM_PROCESSES", "4"),
                ("TG_JAX_COORDINATOR", f"localhost:{port}"), ("TG_JAX_PROCESS_ID", str(i)),
            )  # fmt: skip
    except BaseException:
        _kill(procs)
        raise
    _wait_all(procs, logs, TIMEOUT_S)
    ref, pod = tmp_path / "ref" / "whole", tmp_path / "pod" / "whole"
    a, b = np.load(ref / "final_params.npz"), np.load(pod / "final_params.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(b[k], a[k], rtol=TOL, atol=TOL, err_msg=k)
    exported = np.load(pod / "export" / f"step_{STEPS}" / "params.npz")  # by the trainers
    for k in a.files:
        np.testing.assert_allclose(exported[k], a[k], rtol=TOL, atol=TOL, err_msg=k)
    ma, mb = _train_and_eval(ref), _train_and_eval(pod)
    assert sorted(ma) == sorted(mb) and ("eval", STEPS) in ma
    for key, ra in ma.items():
        for n in (n for n in ra if n != "time" and not n.startswith("time/")):
            if not isinstance(ra[n], str):
                assert mb[key][n] == pytest.approx(ra[n], rel=TOL, abs=TOL), (key, n)
    assert all(mb[("train", s)]["time/publish_s"] > 0 for s in range(1, STEPS + 1))
    sessions = read_rl_summary(str(pod))["sessions"]
    assert [x["start_step"] for x in sessions] == [0, STEPS - 1]  # stopped, then resumed
    for i in range(4):
        assert f"whole process {i}/4 step {STEPS} finished True" in _tail(logs[f"p{i}"])


@pytest.mark.multiprocess
def test_two_process_checkpoint_and_export(runs):
    """Both processes wrote their shards of each checkpoint (orbax); it restores on one
    process to the final params; process 0 exported them."""
    mh = runs["mh"] / "det"
    final = np.load(mh / "final_params.npz")
    step_dir = mh / rl.CHECKPOINT_DIR / str(STEPS) / "state"
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(step_dir))
    meta = ocp.StandardCheckpointer().metadata(step_dir).item_metadata.tree
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    restored = ocp.StandardCheckpointer().restore(step_dir, abstract)
    got = driver.flat_params(restored["params"])
    assert sorted(got) == sorted(final.files)
    for k, v in got.items():
        np.testing.assert_array_equal(v, final[k], err_msg=k)
    exported = np.load(mh / "export" / f"step_{STEPS}" / "params.npz")
    for k in final.files:
        np.testing.assert_array_equal(exported[k], final[k], err_msg=k)


@pytest.mark.multiprocess
def test_two_processes_resume_and_sample_async(runs):
    """The two processes restore the deterministic run's last checkpoint (and its task
    position) and continue with the sampling thread."""
    mh, end = runs["mh"] / "async", STEPS + ASYNC_STEPS
    assert (mh / "final_params.npz").exists()
    train = {r["step"]: r for r in read_metrics(mh) if r["stage"] == "train"}
    assert sorted(train) == list(range(1, end + 1))
    config = driver.make_config("tg", async_sampling=True)
    assert all(train[s]["staleness"] <= config.rl.max_staleness for s in range(STEPS + 1, end + 1))
    assert train[STEPS + 1]["batch_index"] >= STEPS  # the task iterator resumed, not restarted
    summary = read_rl_summary(str(mh))
    assert [s["start_step"] for s in summary["sessions"]] == [0, STEPS]
    assert summary["finished"] and summary["step"] == end
    det_tokens = read_rl_summary(str(runs["mh"] / "det"))["costs"]["sampled_tokens"]
    assert summary["costs"]["sampled_tokens"] > det_tokens  # carried on from the checkpoint


def test_process_slice_shares_without_overlap():
    shares = [multihost.process_slice(6, i, 3) for i in range(3)]
    assert [list(range(6))[s] for s in shares] == [[0, 1], [2, 3], [4, 5]]
    assert multihost.process_slice(4) == slice(0, 4)  # one process: everything
    with pytest.raises(ValueError, match="evenly"):
        multihost.process_slice(5, 0, 2)
    assert multihost.allgather_objects({"a": 1}) == [{"a": 1}]


@pytest.mark.slow
def test_row_ids_make_a_row_sample_the_same_in_any_batch():
    """What lets each host sample its share: a row's draws depend on its id, not its batch."""
    config = driver.make_config()
    model = Transformer(ModelConfig.from_config(config.model))
    params = driver.initial_params(config)
    sampler = Sampler(model, pad_id=0, batch_divisor=4)  # one batch bucket: one compilation
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    rng = jax.random.key(3)
    kw = {"max_new_tokens": 12, "rng": rng}
    whole = sampler.sample(params, prompts, row_ids=[40, 41, 42, 43], **kw)
    alone = sampler.sample(params, prompts[2:3], row_ids=[42], **kw)
    pair = sampler.sample(params, prompts[3:1:-1], row_ids=[43, 42], **kw)
    np.testing.assert_array_equal(alone.tokens[0], whole.tokens[2])
    np.testing.assert_array_equal(pair.tokens[1], whole.tokens[2])
    np.testing.assert_array_equal(pair.tokens[0], whole.tokens[3])
    np.testing.assert_allclose(alone.logprobs[0], whole.logprobs[2], rtol=1e-5, atol=1e-6)
    other = sampler.sample(params, prompts[2:3], row_ids=[7], **kw)
    assert not np.array_equal(other.tokens[0], whole.tokens[2])  # the id matters


def test_a_process_share_rolls_out_what_the_whole_batch_does(monkeypatch):
    """BatchRollout on process 1 of 2: the batch's last two groups, with the group ids, sampling
    key and imperfect-feedback picks that one process rolling out every group gives them."""
    calls = []

    def fake_rollout_groups(sampler, params, renderer, env_factory, tasks, **kw):
        gids = [kw["first_group_id"] + n for n in range(len(tasks))]
        picks = {g: [kw["hint_picker"]("fence", g) for _ in range(20)] for g in gids}
        calls.append((list(tasks), gids, picks, np.asarray(jax.random.key_data(kw["rng"]))))
        return []

    monkeypatch.setattr(rl_rollouts.rollout, "rollout_groups", fake_rollout_groups)
    rates = FeedbackRates(correct=0.5, irrelevant=0.25, wrong=0.25)
    fn = rl_rollouts.BatchRollout(
        None, None, None, rollouts_per_group=2, config=None, sampling_key=jax.random.key(0),
        seed=3, rates=rates,
    )  # fmt: skip
    tasks = ["a", "b", "c", "d"]
    fn(None, 5, tasks, 0)
    share = multihost.process_slice
    monkeypatch.setattr(
        rl_rollouts.multihost, "process_slice", lambda n, index=None, count=None: share(n, 1, 2)
    )
    fn(None, 5, tasks, 0)
    (t_all, g_all, p_all, k_all), (t_1, g_1, p_1, k_1) = calls
    assert t_all == tasks and g_all == [20, 21, 22, 23]
    assert t_1 == ["c", "d"] and g_1 == [22, 23]
    assert p_1 == {g: p_all[g] for g in g_1}
    assert p_all[20] != p_all[21]  # each group its own picks
    np.testing.assert_array_equal(k_1, k_all)


def test_process_gather_merges_the_groups_in_process_order(monkeypatch):
    trajs = [[f"p0-{i}" for i in range(2)], [f"p1-{i}" for i in range(2)]]
    groups = [
        RolloutGroup(trajs[0], policy_version=4, batch_index=7, seconds=1.0, staleness=0),
        RolloutGroup(trajs[1], policy_version=3, batch_index=6, seconds=2.0, staleness=1),
    ]

    class FakeLoop:
        published = None

        def publish(self, params, version):
            self.published = (params, version)

        def get(self, max_staleness, timeout=None):
            return groups[0]

        def stats(self):
            return {"groups_dropped_stale": 0.0}

    p1 = (groups[1], {"groups_dropped_stale": 2.0, "publish_s": 0.5})
    monkeypatch.setattr(rl_rollouts.multihost, "allgather_objects", lambda g: [g, p1])
    fake = FakeLoop()
    gather = rl_rollouts.ProcessGather(fake, lambda p: ("local", p))
    gather.publish("params", 4)
    assert fake.published == (("local", "params"), 4)
    merged = gather.get(1)
    assert merged.trajectories == trajs[0] + trajs[1]
    assert (merged.policy_version, merged.batch_index) == (3, 6)
    assert (merged.seconds, merged.staleness) == (2.0, 1)
    assert gather.stats()["groups_dropped_stale"] == 0.0  # a sampling process: its own
    monkeypatch.setattr(rl_rollouts.multihost, "allgather_objects", lambda g: [g, (None, {})])
    assert gather.get(1) is None  # one process ran out of tasks: all stop
    # A trainer process of the whole-host split plays nothing: the sampler process's group
    # and counters (its sync seconds too) are what it reports.
    trainer = rl_rollouts.ProcessGather(rl_rollouts.NoRollouts(), lambda p: None)
    monkeypatch.setattr(rl_rollouts.multihost, "allgather_objects", lambda g: [g, p1])
    trainer.publish("params", 4)
    merged = trainer.get(1)
    assert merged.trajectories == trajs[1] and merged.policy_version == 3
    assert trainer.stats() == {"groups_dropped_stale": 2.0, "publish_s": 0.5}


_PRIMARY_FIRST = """
import os, sys, time
from tg_jax.tpu import distributed
distributed.initialize_from_env()
import jax
from tg_jax import multihost
path = sys.argv[1]
def write_or_read():
    if not os.path.exists(path):
        time.sleep(0.5 * (jax.process_index() == 0))  # the others would overtake a late writer
        with open(path, "a") as f:
            f.write(f"{jax.process_index()}\\n")
    return open(path).read()
print("read", multihost.primary_first("test", write_or_read).strip())
print("agreed", multihost.agreed(jax.process_index() + 10))
"""


def _two_processes(script: str, *args: str, count: int = 2) -> list[subprocess.Popen]:
    """`python -c script args` as processes 0 and 1 (0 .. count - 1) of one `jax.distributed`
    runtime."""
    port = _free_port()
    procs = []
    for i in range(count):
        env = {**os.environ, "TG_JAX_DISTRIBUTED": "1", "TG_JAX_NUM_PROCESSES": str(count),
               "TG_JAX_COORDINATOR": f"localhost:{port}", "TG_JAX_PROCESS_ID": str(i),
               "JAX_PLATFORMS": "cpu"}  # fmt: skip
        env.pop("XLA_FLAGS", None)
        procs.append(subprocess.Popen(
            [sys.executable, "-c", script, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    return procs


@pytest.mark.multiprocess
def test_primary_first_writes_once_and_agreed_is_process_0_s(tmp_path):
    """Two processes: the shared file is written by process 0 alone and read by both; agreed()
    gives process 0's value everywhere."""
    procs = _two_processes(_PRIMARY_FIRST, str(tmp_path / "shared.txt"))
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        assert "read 0" in out and "agreed 10" in out, out
    assert (tmp_path / "shared.txt").read_text() == "0\n"


_GATHER = """
import numpy as np
from tg_jax.tpu import distributed
distributed.initialize_from_env()
import jax
from jax.experimental import multihost_utils
from tg_jax import multihost
widths = []
real = multihost_utils.process_allgather
def recording(x, *a, **k):
    out = real(x, *a, **k)
    widths.append(tuple(np.asarray(out).shape))
    return out
multihost_utils.process_allgather = recording
me = jax.process_index()
rng = np.random.default_rng(me)
# process 0: 5 KiB; process 1: 300 KiB, over 64 KiB chunks: five gathers of [2, 65536].
obj = {"me": me, "data": rng.integers(0, 255, 5_000 if me == 0 else 300_000, np.uint8)}
got = multihost.allgather_objects(obj, chunk_bytes=1 << 16)
want = [np.random.default_rng(p).integers(0, 255, n, np.uint8)
        for p, n in ((0, 5_000), (1, 300_000))]
assert [g["me"] for g in got] == [0, 1], got
assert all(np.array_equal(g["data"], w) for g, w in zip(got, want)), "data differ"
small = multihost.allgather_objects(("tiny", me), chunk_bytes=1 << 16)
assert small == [("tiny", 0), ("tiny", 1)], small
print("widths", widths, flush=True)
"""


@pytest.mark.multiprocess
def test_objects_cross_hosts_a_chunk_at_a_time():
    """`allgather_objects` between 2 processes: objects of 5 KiB and 300 KiB come back whole
    in process order through gathers of [2, 64 KiB] (chunk_bytes 64 KiB: five of them, not
    one [2, 512 KiB] power-of-two buffer); a small object in one [2, 4 KiB] gather."""
    procs = _two_processes(_GATHER)
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        sizes = [(2, 1)] + [(2, 1 << 16)] * 5 + [(2, 1), (2, 4096)]  # (2, 1): the sizes
        assert f"widths {sizes}" in out, out


_ROLES = """
from tg_jax.tpu import distributed
distributed.initialize_from_env()
import jax
from tests import rl_loop_driver as driver
from tg_jax.errors import RunError
from tg_jax.train import rl_hosts
config = driver.make_config("tg", False, 1)
config.sampler_mesh.processes = 2 if jax.process_index() == 2 else 1  # process 2 differs
try:
    rl_hosts.roles(config)
except RunError as e:
    print("refused:", e, flush=True)
"""


@pytest.mark.multiprocess
def test_processes_that_name_different_sampler_processes_are_refused():
    """The whole-host split's roles are agreed by every process: 3 processes, one given
    another `sampler_mesh.processes`, all stop with the same clear error (no hang)."""
    procs = _two_processes(_ROLES, count=3)
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert f"refused: process {i}: the processes name different sampler processes " in out
        assert "[(2,), (2,), (1, 2)], by process" in out, out


_BARRIER = """
import sys, time
from tg_jax.tpu import distributed
distributed.initialize_from_env()
import jax
from tg_jax import multihost
multihost.barrier("both", timeout_s=60)
print("passed both", flush=True)
if jax.process_index() == 1:  # leaves process 0 alone at the next barrier
    time.sleep(20)
    sys.exit(0)
start = time.monotonic()
try:
    multihost.barrier("second", timeout_s=4)
except multihost.BarrierError as e:
    print(f"after {time.monotonic() - start:.0f} s:", e, flush=True)
    sys.exit(3)
"""


@pytest.mark.multiprocess
def test_a_barrier_a_process_misses_fails_with_its_name_not_a_hang():
    procs = _two_processes(_BARRIER)
    out0, err0 = procs[0].communicate(timeout=120)
    procs[1].communicate(timeout=120)
    assert procs[0].returncode == 3, err0[-2000:]
    assert "passed both" in out0
    line = out0.splitlines()[-1]
    assert "barrier 'second' not reached by every one of 2 processes within 4 s" in line, line
    assert "tasks that reached the barrier: 1/2" in line, line
    assert int(line.split()[1]) < 15, line  # the barrier's timeout, not process 1's exit


def test_the_barrier_timeout_is_an_hour_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.delenv("TG_JAX_BARRIER_TIMEOUT_S", raising=False)
    assert multihost.barrier_timeout_s() == multihost.BARRIER_TIMEOUT_S == 3600
    monkeypatch.setenv("TG_JAX_BARRIER_TIMEOUT_S", "90")
    assert multihost.barrier_timeout_s() == 90.0


def test_cpu_processes_get_a_collective_timeout(monkeypatch):
    """A multi-process CPU run fails a stuck gloo collective after COLLECTIVE_TIMEOUT_S (or
    TG_JAX_COLLECTIVE_TIMEOUT_S) instead of hanging; a timeout in XLA_FLAGS stands."""
    from tg_jax.tpu import distributed

    flag = "--xla_cpu_collective_timeout_seconds"
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    distributed.collective_timeout({})
    assert os.environ["XLA_FLAGS"] == (
        f"--xla_force_host_platform_device_count=4 {flag}={distributed.COLLECTIVE_TIMEOUT_S}"
    )
    monkeypatch.delenv("XLA_FLAGS")
    distributed.collective_timeout({distributed.ENV_COLLECTIVE_TIMEOUT: "42"})
    assert os.environ["XLA_FLAGS"] == f"{flag}=42"
    distributed.collective_timeout({distributed.ENV_COLLECTIVE_TIMEOUT: "7"})  # already set
    assert os.environ["XLA_FLAGS"] == f"{flag}=42"


def test_uneven_process_shares_cover_every_item_once_in_order():
    """The held-out tasks' split (`multihost.process_share`): contiguous, in process order,
    the first n % P shares one longer, empty ones when n < P."""
    share = multihost.process_share
    assert [list(range(5))[share(5, i, 2)] for i in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(range(7))[share(7, i, 3)] for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [list(range(2))[share(2, i, 4)] for i in range(4)] == [[0], [1], [], []]
    for n, count in ((0, 2), (9, 4), (16, 8)):
        got = [i for p in range(count) for i in range(n)[share(n, p, count)]]
        assert got == list(range(n))
    with pytest.raises(ValueError, match="not one of 2"):
        share(4, 2, 2)


def test_merged_shares_are_in_one_process_s_order():
    """`heldout.merge_shares`: condition by condition (as asked), sample by sample, task by
    task, each record with its trajectory."""
    from tg_jax.evaluation import heldout
    from tg_jax.sampling.episode import EpisodeRecord

    def rec(task, cond, s):
        return EpisodeRecord(task_id=task, condition=cond, sample=s, task_success=False,
                             compliance={}, actions={}, turns=1)  # fmt: skip

    def share(tasks):  # a process's episodes as heldout_episodes orders them
        recs = [rec(t, c, s) for c in ("hinted", "plain") for s in range(2) for t in tasks]
        return recs, [f"{r.condition}{r.sample}{r.task_id}" for r in recs]

    records, trajs = heldout.merge_shares([share("ab"), share("c")], ("hinted", "plain"))
    want = [f"{c}{s}{t}" for c in ("hinted", "plain") for s in range(2) for t in "abc"]
    assert trajs == want
    assert [f"{r.condition}{r.sample}{r.task_id}" for r in records] == want
    records, trajs = heldout.merge_shares([(share("ab")[0], []), ([], [])], ("hinted", "plain"))
    assert len(records) == 8 and trajs == []  # trajectories not gathered


@pytest.mark.slow
def test_each_process_plays_its_share_of_the_heldout_tasks_as_one_process_would(monkeypatch):
    """`heldout.split_episodes` as processes 0 and 1 of 2 (process index and count, the
    per-process sampler and the gather faked in this process): each plays its contiguous share
    of 5 tasks (3 and 2) after the params' copy, gathers once, and the merged episodes are one
    process's, token for token, at temperature 1 (each episode's key is its task position's,
    not its place in the share: the share played from stream 0 samples other tokens)."""
    from configs import tiny
    from tg_jax import config_files
    from tg_jax.envs.tasks import generate_tasks
    from tg_jax.evaluation import heldout
    from tg_jax.models import init_params
    from tg_jax.text import ByteTokenizer, ChatRenderer

    renderer = ChatRenderer(ByteTokenizer())
    config = config_files.apply_overrides(
        tiny.get_config(), {"rl_loop.rollout_engine": "lockstep"}
    )  # fmt: skip
    params = init_params(Transformer(ModelConfig.from_config(config.model)), jax.random.key(0))
    tasks = generate_tasks("heldout", 5, seed=0)
    sampler = heldout.make_sampler(config, renderer)
    kw = {"conditions": ("hinted", "plain"), "samples_per_task": 2, "temperature": 1.0,
          "max_new_tokens": 8, "renderer": renderer}  # fmt: skip
    whole = heldout.heldout_episodes(config, params, tasks, sampler=sampler, **kw)
    assert len(whole[0]) == 2 * 2 * 5

    calls, gathered = [], []

    def copy(config_, params_, renderer_):
        calls.append("copy")
        return sampler, params_, (0, 1)

    def gather(obj):
        calls.append("gather")
        gathered.append(obj)
        return [obj]

    played = []
    real = heldout.heldout_episodes

    def spy(config_, params_, tasks_, **kw_):
        played.append(([t.task_id for t in tasks_], kw_["first_stream"]))
        return real(config_, params_, tasks_, **kw_)

    monkeypatch.setattr(heldout, "process_sampler", copy)
    monkeypatch.setattr(heldout, "heldout_episodes", spy)
    monkeypatch.setattr(heldout.multihost, "allgather_objects", gather)
    for p in (0, 1):
        with monkeypatch.context() as m:
            m.setattr(jax, "process_count", lambda: 2)
            m.setattr(jax, "process_index", lambda p=p: p)
            heldout.split_episodes(config, params, tasks, **kw)
    assert calls == ["copy", "gather"] * 2  # per process: the copy, then one gather
    ids = [t.task_id for t in tasks]
    assert played == [(ids[:3], 0), (ids[3:], 3)]
    records, trajs = heldout.merge_shares(gathered, kw["conditions"])
    assert records == whole[0]
    for a, b in zip(whole[1], trajs, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    from_zero = real(config, params, tasks[3:], sampler=sampler, **kw)[1]
    assert any(not np.array_equal(a.tokens, b.tokens) for a, b in
               zip(from_zero, gathered[1][1], strict=True))  # fmt: skip


def test_only_process_0_reads_the_heldout_ledger_for_the_final_evaluation(tmp_path, monkeypatch):
    """`heldout_reads.agreed_check`: process 1 of a pod takes process 0's verdict instead of
    reading the ledger, where process 0 may already have written this read's start line (read
    there, it is a "second look": process 1 exited with that error while process 0 waited in
    the evaluation's gather); a refusal by process 0 is raised on every process."""
    from tg_jax.evaluation import heldout_reads as hr

    w = str(tmp_path)
    hr.start_read(w, hr.FINAL, "tg_seed0", tasks=2)  # process 0's start line of this read
    with pytest.raises(hr.HeldoutReadError, match="already evaluated"):
        hr.check_read(w, hr.FINAL, "tg_seed0")  # what process 1 read
    monkeypatch.setattr(hr.multihost, "is_primary", lambda: False)
    sent = []
    monkeypatch.setattr(hr.multihost, "agreed", lambda v: sent.append(v) or (False, ""))
    assert hr.agreed_check(w, hr.FINAL, "tg_seed0") is False  # process 0 found no earlier read
    assert sent == [(False, "")]  # process 1 checked nothing itself
    monkeypatch.setattr(hr.multihost, "agreed", lambda v: (False, "run tg_seed0 was already"))
    with pytest.raises(hr.HeldoutReadError, match="already"):
        hr.agreed_check(w, hr.FINAL, "tg_seed0")
