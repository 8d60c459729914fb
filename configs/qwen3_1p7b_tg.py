"""Qwen3-1.7B (dense) + targeted guidance on one TPU host (v5p-8: 4 chips), from its checkpoint.

The published TG recipe (200 steps, 32 groups x 32 rollouts, one epoch, async sampling) at a
size one host trains: for trying the method on a real checkpoint before paying for a pod
slice. RL starts from the Hugging Face checkpoint (no SFT); builds on configs/hf_tg.py.

Launch on a single-host slice (the same launcher as the pods; it copies the checkpoint to the
worker and passes it as model.hf_checkpoint):
    bash launch/tpu.sh --name=tg-1p7b --zone=us-east5-a --project=PROJECT --topology=v5p:2x2x1 \
        --config=configs/qwen3_1p7b_tg.py --workdir=gs://BUCKET/runs/tg-1p7b \
        --hf-checkpoint=gs://BUCKET/Qwen3-1.7B

or directly on a TPU VM with the checkpoint on local disk:
    python -m tg_jax.main --config=configs/qwen3_1p7b_tg.py --workdir=gs://BUCKET/runs/tg-1p7b \
        --config.model.hf_checkpoint=/path/to/Qwen3-1.7B

Check the fit on a CPU machine first (README: measured figures):
    PYTHONPATH=LIBTPU_DIR python -m tg_jax.tpu.aot --config=configs/qwen3_1p7b_tg.py \
        --topology=v5p:2x2x1

`configs/qwen3_1p7b_tg.py:runlocal` keeps these settings' structure but takes the architecture
from the checkpoint and shrinks the loop (a tiny checkpoint on a CPU; the tests use it).
"""

import os

from tg_jax import config_files

# One train step = GROUPS x ROLLOUTS rows padded to SEQ_LEN tokens.
GROUPS, ROLLOUTS, SEQ_LEN = 32, 32, 8192
ROWS_PER_MICRO_BATCH = 8  # rows of one micro-batch over the 4 chips (2 per chip; from aot)


def get_config(arg=None):
    c = config_files.load_config_file(os.path.join(os.path.dirname(__file__), "hf_tg.py"), arg)
    c.tg.gate = "failed_turns"  # distil failed turns only
    c.tg.include_thinking = True  # also distil thinking tokens (reduces oscillation)
    if arg == "runlocal":
        return c
    # Architecture of Qwen/Qwen3-1.7B (its config.json), checked against the checkpoint's.
    c.model.update(
        vocab_size=151_936,  # Qwen3 tokenizer
        d_model=2048,  # hidden_size
        num_layers=28,  # num_hidden_layers
        num_heads=16,  # num_attention_heads
        num_kv_heads=8,  # num_key_value_heads
        head_dim=128,  # head_dim
        mlp_dim=6144,  # intermediate_size
        rope_theta=1_000_000.0,  # rope_theta
        rms_norm_eps=1e-6,  # rms_norm_eps
        tie_embeddings=True,  # tie_word_embeddings
        num_experts=0,  # dense
        experts_per_token=0,
        moe_mlp_dim=0,
        norm_topk_prob=True,
        router_aux_loss_coef=0.0,
        param_dtype="float32",  # fp32 master weights and AdamW moments
        dtype="bfloat16",  # bf16 activations and matmuls on TPU
        remat_policy="full",  # recompute each layer in the backward pass (long sequences)
        max_seq_len=SEQ_LEN + 512,  # student rows + the hints inserted in teacher rows
    )
    c.mesh.shape = (1, 4, 1, 1)  # data, fsdp, tensor, expert: 4-way FSDP over the host's chips
    c.rl.micro_batches = GROUPS * ROLLOUTS // ROWS_PER_MICRO_BATCH  # gradient accumulation
    c.rl.max_staleness = 1  # async: rollouts from the previous policy version are accepted
    c.tg.chunk_size = 512  # positions per chunk of the full-vocabulary KL (V = 151,936)
    c.optim.lr = 1e-6  # RL fine-tuning: small, constant
    c.optim.total_steps = 200  # schedule length = the run
    c.rl_loop.steps = 200  # published: 200 RL steps
    c.rl_loop.epochs = 1.0  # published: one epoch (200 x 32 = 6400 train tasks, checked)
    c.tasks.num_train = 200 * GROUPS
    c.rl_loop.groups_per_step = GROUPS  # published: 32 groups (tasks) per step
    c.rl_loop.rollouts_per_group = ROLLOUTS  # published: 32 rollouts per task
    c.rl_loop.seq_len = SEQ_LEN  # padded student length of a batch
    c.rl_loop.async_sampling = True  # published: async RL (sampler runs ahead, staleness <= 1)
    c.rl_loop.max_new_tokens = 2048  # decode budget per assistant turn
    # The lock-step sampler's whole call (prefill and decode loop) at 256 rows x 8192 slots
    # needs 98 GiB per chip, the evaluation's at 128 rows 112 GiB; at 64 rows 50.7 and 29.6
    # GiB, beside the train step 80.8 of v5p's 95 (python -m tg_jax.tpu.fit; docs/tpu.md):
    # rollouts and evaluations are sampled 64 episodes at a time.
    c.sampler_mesh.max_rows = 64
    # Lock-step rollouts: the engine has not run on a TPU yet (its fit is compiled, below;
    # on an H200 its paged decode step was slower than the lock-step sampler's, docs/benchmarks.md).
    c.rl_loop.rollout_engine = "lockstep"
    # The built-in engine (--config.rl_loop.rollout_engine=builtin) decodes the step's 1024
    # episodes at once over a KV pool of 1.5M tokens (1465 a live episode on average; past it
    # the newest is preempted and requeued): its decode call is 50.2 GiB per chip; beside the
    # train step 34.9 + 41.2 (its weights and pool) + 4.1 = 80.2 GiB of 95
    # (python -m tg_jax.tpu.aot --what=engine; docs/tpu.md).
    c.rl_loop.engine_kv_tokens = 1_500_000
    c.rl_loop.checkpoint_every = 10  # lose at most 10 steps to a preemption
    c.rl_loop.eval_every = 50  # held-out evaluation interval
    return c
