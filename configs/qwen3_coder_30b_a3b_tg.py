"""Qwen3-Coder-30B-A3B + targeted guidance at the published settings, on a TPU v5p slice.

200 RL steps of 32 groups x 32 rollouts, one epoch over the tasks, async sampling (docs/design.md
section 1), RL from the Hugging Face checkpoint (no SFT), bf16 compute with fp32 master
weights, full rematerialisation, expert parallelism, MoE router replay. Builds on
configs/hf_tg.py: every section not set here (env, tasks, tg options, ...) is that config's.

Launch (creates the slice, installs on every worker, runs, resumes after preemption):
    bash launch/tpu.sh --name=tg-30b --zone=us-east5-a --project=PROJECT --topology=v5p:2x4x4 \
        --config=configs/qwen3_coder_30b_a3b_tg.py --workdir=gs://BUCKET/runs/tg-30b \
        --hf-checkpoint=gs://BUCKET/Qwen3-Coder-30B-A3B-Instruct --spot --queued

Check first, on any CPU machine, that the train and sample steps fit the slice's HBM
(`pip install -e .[aot]`; configs/hf/qwen3_coder_30b_a3b holds the published config.json):
    python -m tg_jax.tpu.aot --config=configs/qwen3_coder_30b_a3b_tg.py --topology=v5p:2x4x4 \
        --config.model.hf_checkpoint=configs/hf/qwen3_coder_30b_a3b
(README: measured figures).

Either runs `python -m tg_jax.main --config=configs/qwen3_coder_30b_a3b_tg.py --workdir=...
--config.model.hf_checkpoint=DIR` (the launcher passes the copy it made on each worker).
`configs/qwen3_coder_30b_a3b_tg.py:runlocal` takes the architecture from the checkpoint and
shrinks the loop (a tiny MoE checkpoint on a CPU; the tests use it).
`configs/qwen3_coder_30b_a3b_tg.py:split` puts the trainer and the sampler on their own 32
chips each of a v5p-128, 2 + 2 on every host (`config.sampler_mesh`; docs/tpu.md: both
steps' fit); `:runlocal_split` is that layout on a tiny checkpoint (trainer 4 + sampler 4 CPU
devices: one process, or 2 + 2 on each of a local pod's 2 processes).
`:whole` is the whole-host split of a v5p-128: 8 hosts train, 8 sample (docs/tpu.md);
`:runlocal_whole` is the whole-host split on a tiny checkpoint: a local pod of 4 processes x 2
CPU devices, the first 2 processes train (a trainer mesh of 4), the last 2 sample
(`sampler_mesh.processes`; tests/test_launch.py).
"""

import os

from tg_jax import config_files, config_lib
from tg_jax.mesh_settings import DEFAULT_RULES

# One train step = GROUPS x ROLLOUTS rows; padded to SEQ_LEN tokens (multi-turn agentic coding
# episodes: prompt, tool outputs and several assistant turns).
GROUPS, ROLLOUTS, SEQ_LEN = 32, 32, 8192


def get_config(arg=None):
    if arg not in (None, "", "runlocal", "split", "whole", "runlocal_split", "runlocal_whole"):
        raise ValueError(
            f"{__file__} takes no argument, 'runlocal', 'split', 'whole', 'runlocal_split' or "
            f"'runlocal_whole', not {arg!r}"
        )
    base_arg = {"split": None, "whole": None}.get(arg, "runlocal" if arg else arg)
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "hf_tg.py"), base_arg)
    c.tg.gate = "failed_turns"  # distil failed turns only (feedback on all turns can hurt)
    # Qwen3-Coder has no thinking (its template drops reasoning_content): nothing to distil
    # but answers (tg.include_thinking = True is refused at start-up for such a template).
    c.tg.include_thinking = False
    # MoE router replay (R3): the trainer's student and teacher forwards route each token to
    # the experts the rollout routed it to (Qwen3-30B-A3B GRPO runs collapsed without it in
    # Megatron-LM issue 4168). Compiled for v5p-64 it costs the train step 6.6 GiB per chip
    # (its records 0.4 GiB, the replaying forwards the rest) and a decode call its rows'
    # record (docs/tpu.md).
    c.model.router_replay = True
    if arg == "runlocal_split":  # the split layout, tiny: trainer 4 + sampler 4 CPU devices
        _split(c, num_devices=4, tensor=2)
    if arg == "runlocal_whole":  # the whole-host split, tiny: 2 trainer + 2 sampler processes
        c.sampler_mesh = config_lib.sampler_mesh_config(shape=(-1, 2))
        c.sampler_mesh.processes = 2
        c.tg.compact = False
    if arg in ("runlocal", "runlocal_split", "runlocal_whole"):
        return c
    # Architecture of Qwen/Qwen3-Coder-30B-A3B-Instruct (its config.json): 30.5B parameters,
    # 3.3B active per token, checked against the checkpoint's config.json.
    c.model.update(
        vocab_size=151_936,  # Qwen3 tokenizer
        d_model=2048,  # hidden_size
        num_layers=48,  # num_hidden_layers
        num_heads=32,  # num_attention_heads
        num_kv_heads=4,  # num_key_value_heads
        head_dim=128,  # head_dim
        mlp_dim=5472,  # intermediate_size (unused: every layer is MoE, mlp_only_layers = [])
        rope_theta=10_000_000.0,  # rope_theta
        rms_norm_eps=1e-6,  # rms_norm_eps
        tie_embeddings=False,  # tie_word_embeddings
        param_dtype="float32",  # fp32 master weights (and fp32 AdamW moments)
        dtype="bfloat16",  # bf16 activations and matmuls on TPU
        remat_policy="full",  # recompute each layer in the backward pass (long sequences)
        max_seq_len=SEQ_LEN + 512,  # student rows + the hints inserted in teacher rows
        num_experts=128,  # num_experts
        experts_per_token=8,  # num_experts_per_tok
        moe_mlp_dim=768,  # moe_intermediate_size
        norm_topk_prob=True,  # norm_topk_prob
        router_aux_loss_coef=0.0,  # load-balancing loss weight in the train step: off
    )
    # v5p-64 (2x4x4 = 32 chips): 8-way FSDP x 4-way expert parallelism; the batch is split
    # over all 32 chips (expert axis included: the MoE all-gathers tokens over it, see
    # tg_jax/models/moe.py). Chosen with tg_jax.tpu.aot (figures in the docstring command).
    c.mesh.shape = (1, 8, 1, 4)  # data, fsdp, tensor, expert
    c.mesh.rules = tuple(
        (name, ("data", "fsdp", "expert") if name == "batch" else target)
        for name, target in DEFAULT_RULES
    )  # logical axis -> mesh axes: DEFAULT_RULES with the batch over the expert axis too
    c.rl.micro_batches = GROUPS * ROLLOUTS // 32  # one row per chip per micro-batch (HBM)
    # Each host (4 chips) samples its share of the rows with its own bf16 copy of the weights
    # split 4 ways (one KV head per chip): 14.2 GiB per chip, not a 57 GiB replica (README).
    c.sampler_mesh.shape = (-1, 4)
    # Full teacher rows, and a host's 128 rollouts decoded 64 at a time: with async sampling the
    # train step and a host's sampler (its weights, one call's KV cache) are on the chips at
    # once: 58.1 + 14.2 + 12.4 = 84.7 GiB of 95 with router replay (all 128 rows in one call:
    # 97.1; compact rows, 77.9 GiB for the step without replay, more). docs/tpu.md.
    c.tg.compact = False
    c.sampler_mesh.max_rows = 64
    # Lock-step rollouts: the engine has not run on a TPU yet (its fit is compiled, below;
    # on an H200 its paged decode step was slower than the lock-step sampler's, docs/benchmarks.md).
    c.rl_loop.rollout_engine = "lockstep"
    # The built-in engine (--config.rl_loop.rollout_engine=builtin): a host's 128 episodes in
    # its slots over a KV pool of 524,288 tokens (4096 a live episode on average; past it the
    # newest is preempted and requeued). Compiled for v5p-64 its decode call is 40.7 GiB per
    # chip; beside the train step 72.3 + 0.6 (its own weight copies) + 12.4 (pool) + 1.0 =
    # 86.3 GiB of 95 (python -m tg_jax.tpu.aot --what=engine; docs/tpu.md).
    c.rl_loop.engine_kv_tokens = 524_288
    c.rl.max_staleness = 1  # async: rollouts from the previous policy version are accepted
    c.rl.temperature = 1.0  # sampling temperature (trainer logits divided by it)
    c.tg.chunk_size = 512  # positions per chunk of the full-vocabulary KL (V = 151,936)
    c.optim.lr = 1e-6  # RL fine-tuning of a 30B model: small, constant
    c.optim.total_steps = 200  # schedule length = the run
    c.rl_loop.steps = 200  # published: 200 RL steps
    c.rl_loop.epochs = 1.0  # published: one epoch (200 x 32 = 6400 train tasks, checked)
    c.tasks.num_train = 200 * GROUPS
    c.rl_loop.groups_per_step = GROUPS  # published: 32 groups (tasks) per step
    c.rl_loop.rollouts_per_group = ROLLOUTS  # published: 32 rollouts per task
    c.rl_loop.seq_len = SEQ_LEN  # padded student length of a batch
    c.rl_loop.async_sampling = True  # published: async RL (sampler runs ahead, staleness <= 1)
    c.rl_loop.max_new_tokens = 2048  # decode budget per assistant turn
    c.rl_loop.checkpoint_every = 10  # preemptible slices: lose at most 10 steps
    c.rl_loop.eval_every = 50  # held-out evaluation interval
    if arg == "split":
        _split(c)
    if arg == "whole":
        _whole(c)
    return c


def _whole(c):
    """`:whole`: the whole-host split on a v5p-128 (4x4x4, 16 hosts of 4 chips): hosts 0-7
    train (32 chips, the mesh above: fsdp 8 x expert 4), hosts 8-15 sample, each on its 4 chips
    with its own bf16 copy split 4 ways (one KV head per chip), 128 of a step's 1024 rows, 64 a
    call. After each step the weights are staged on the trainer's chips (a bf16 copy per 4
    chips) and copied to the sampler hosts' chips across hosts (`sampler_mesh.processes`,
    `placement.HostTransfer`; docs/tpu.md: both steps' fit)."""
    c.sampler_mesh = config_lib.sampler_mesh_config(shape=(-1, 4))
    c.sampler_mesh.processes = 8
    c.sampler_mesh.max_rows = 64
    c.tg.compact = False  # full teacher rows, as above


def _split(c, num_devices=32, tensor=2):
    """`:split`: the trainer and the sampler on their own 32 chips each of a v5p-128 (4x4x4,
    16 hosts of 4 chips): every host trains on its first 2 chips (one trainer mesh of 32, as
    above) and samples its share of the rows (64 of 1024) on its last 2, with its own bf16
    copy of the weights split 2 ways (2 of the 4 KV heads per chip), copied from its trainer
    chips after each step (`sharding.split_devices`, `placement.HostReplicas`; docs/tpu.md).
    On one process (`:runlocal_split` on 8 CPU devices) the last 4 devices sample."""
    # The last chips sample: data-parallel replicas x `tensor`-way tensor parallel.
    c.sampler_mesh = config_lib.sampler_mesh_config(num_devices=num_devices, shape=(-1, tensor))
    # Full teacher rows: compact rows keep every layer's student prefix for the teacher (77.9
    # GiB per chip), which with the staged copy of the params for the sampler (28.5 GiB) would
    # not fit; full rows: 51.4 + 28.5 GiB (README).
    c.tg.compact = False
