"""Test-wide JAX settings: CPU, 8 simulated devices, quick compiles (here and in the commands
the tests run), strict rank promotion, persistent cache; the markers and the files' order."""

import gc
import importlib.util
import os
import signal

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing is downloaded in tests (CI reaches only the package registries): Hugging Face
# libraries read local files only, and fail at once instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# 8 simulated CPU devices in the test processes, set in JAX's config rather than the
# environment (XLA_FLAGS or JAX_NUM_CPU_DEVICES, when set, stand): a command a test runs in a
# subprocess gets one CPU device, as a user's CPU run does, and keeps its persistent
# compilation cache (several CPU devices in one process compile afresh:
# tg_jax.tpu.distributed.no_persistent_cache_on_cpu). A test of sharding or of a pod gives its
# subprocesses their devices itself (tg_jax.tpu.distributed.cpu_devices_env).
TEST_DEVICES = 8
from tg_jax.tpu import distributed  # noqa: E402

_asked = distributed.local_cpu_devices(os.environ, default=0)
_own_nproc = "NPROC" not in os.environ
# Before the CPU client exists: intra-op threads enough for the devices' blocking collectives
# (what tg_jax.main sets for its own runs).
distributed.threads_for_blocking_collectives({"JAX_NUM_CPU_DEVICES": str(_asked or TEST_DEVICES)})

from tests import compile_settings  # noqa: E402

# XLA:CPU's quick compile settings (tests/compile_settings.py) for this process and, through
# XLA_FLAGS, for every command a test runs in a subprocess.
os.environ.update(compile_settings.with_quick_flags(os.environ))

import jax  # noqa: E402
import pytest  # noqa: E402

if not _asked:
    jax.config.update("jax_num_cpu_devices", TEST_DEVICES)
jax.devices()  # the CPU client, made now with its threads and flags
if _own_nproc:  # the subprocesses size their own pools
    os.environ.pop("NPROC", None)
jax.config.update("jax_numpy_rank_promotion", "raise")
# The subprocesses' cache (TG_JAX_COMPILATION_CACHE, set for them here when it was not), and
# this process's own directory under it.
os.environ["TG_JAX_COMPILATION_CACHE"] = compile_settings.cache_root()
jax.config.update(
    "jax_compilation_cache_dir",
    os.path.join(compile_settings.cache_root(), compile_settings.IN_PROCESS_CACHE),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The files that take longest (seconds summed over their tests, 2-vCPU Intel Xeon, empty
# compilation cache, at 8dd6830 with the quick flags of compile_settings.py), first: whole
# files go to the 2 workers in this order (--dist loadfile --no-loadscope-reorder), and a
# long file started last would end the run with the other worker idle.
LONGEST_FIRST = (
    "test_gcs.py",  # the multiprocess files: one unit of work, 367 s together
    "test_multihost.py",
    "test_launch.py",
    "test_faults.py",  # 140 s
    "test_pipeline.py",  # 137 s
    "test_vllm_engine.py",  # 136 s
    "test_bench.py",  # 120 s
    "test_tuning.py",  # 114 s
    "test_swe_run.py",  # 110 s
    "test_hidden_thinking.py",  # 102 s
    "test_soak.py",  # 99 s
    "test_shipped_base.py",  # 98 s
    "test_hf_run.py",  # 94 s
    "test_teacher.py",  # 87 s
    "test_chat_format_runs.py",  # 87 s
    "test_router_replay_train.py",  # 86 s
    "test_train_step.py",  # 86 s
    "test_split_mesh.py",  # 84 s
    "test_ppo_updates.py",  # 82 s
)
# The files with tests marked multiprocess (test_layout checks the list): local pods and gloo
# slow whatever runs beside them (test_gcs took 753 s beside test_multihost, 488 s without),
# so they are one unit of work, which one worker runs one file after another.
MULTIPROCESS_FILES = ("test_gcs.py", "test_multihost.py", "test_launch.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, the files of MULTIPROCESS_FILES as one unit of work."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "multiprocess" if os.path.basename(path) in MULTIPROCESS_FILES else path

    return Scheduling(config, log)


# The lane (launch/local.sh): "py312" runs test-fast's tier on the pods' versions without the
# reference stack, where a test whose import of one fails is skipped and counted; in any other
# lane the stack must be installed (one error before any test), so none skips for its absence.
LANE = os.environ.get("TG_JAX_LANE", "main")
REFERENCE_STACK = ("torch", "transformers", "vllm")
# Where that import may fail and skip: the tests' code and the package's two modules of optional
# dependencies. Anywhere else in tg_jax it fails the test (a pod without vLLM has no torch).
OPTIONAL_IMPORTERS = ("tests/", "tg_jax/bench/hf_reference.py", "tg_jax/engine/vllm_engine.py")
NOT_IN_LANE = "not in the py312 lane: "  # the reason of those skips, which the summary counts
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_lane_skips: list[str] = []


def pytest_configure(config):
    missing = [name for name in REFERENCE_STACK if importlib.util.find_spec(name) is None]
    if missing and LANE != "py312":
        raise pytest.UsageError(
            f"error: {', '.join(missing)} not installed, and TG_JAX_LANE={LANE!r}: their tests "
            "would fail; install them (bash launch/local.sh test), or run the lane without "
            "them (bash launch/local.sh test-py312)"
        )


def _importer(exc: BaseException) -> str:
    """The repository-relative path of the code whose import raised exc."""
    path, tb = "", exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not name.startswith("<") and f"{os.sep}importlib{os.sep}" not in name:
            path = name
        tb = tb.tb_next
    return os.path.relpath(path, REPO).replace(os.sep, "/") if path else ""


def _missing_reference(exc: BaseException | None) -> str | None:
    """The uninstalled module of REFERENCE_STACK whose import in OPTIONAL_IMPORTERS raised exc
    or one of its causes, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        top = (getattr(exc, "name", None) or "").split(".")[0]
        if isinstance(exc, ModuleNotFoundError) and top in REFERENCE_STACK:
            absent = importlib.util.find_spec(top) is None
            return top if absent and _importer(exc).startswith(OPTIONAL_IMPORTERS) else None
        exc = exc.__cause__ or exc.__context__
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    missing = LANE == "py312" and call.excinfo and _missing_reference(call.excinfo.value)
    if missing:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), (item.location[1] or 0) + 1, NOT_IN_LANE + missing)
    return report


def pytest_runtest_logreport(report):
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, (tuple, list)) and NOT_IN_LANE in longrepr[2]:
        _lane_skips.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if LANE == "py312":
        terminalreporter.write_line(
            f"py312 lane: {len(_lane_skips)} tests skipped for lacking "
            f"{', '.join(REFERENCE_STACK)} (reason '{NOT_IN_LANE}MODULE')",
            bold=True,
        )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each test file's compiled programs when it ends: a test worker runs many files,
    and their in-memory executables would otherwise add up over the whole run (the persistent
    cache keeps later compiles of the same programs cheap)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def restore_sigterm():
    """Tests that raise a real SIGTERM: the preemption flag cleared and the handler restored."""
    from tg_jax import checkpointing

    checkpointing.clear_preemption_request()
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)
    checkpointing.clear_preemption_request()


@pytest.fixture(scope="module")
def make_bpe_renderer(tmp_path_factory):
    """(texts, vocab_size) -> a ChatRenderer of a byte-level BPE trained on `texts` (written
    as Hugging Face files and loaded back, as `sft.tokenizer = "bpe"` does)."""
    from tg_jax.text import ChatRenderer, HFTokenizer, bpe

    def make(texts, vocab_size):
        path = str(tmp_path_factory.mktemp("bpe"))
        bpe.write_bpe_tokenizer(path, texts, vocab_size)
        return ChatRenderer(HFTokenizer.from_dir(path))

    return make
