"""RL from your own Hugging Face checkpoint (Qwen3 / Qwen3-MoE): GRPO or TG, no SFT.

    python -m tg_jax.main --config=configs/hf_tg.py --workdir=W --config.model.hf_checkpoint=DIR

DIR (a local directory or gs://...) is what transformers' `save_pretrained` writes, with the
tokenizer (tokenizer.json) and its chat template, which renders every conversation and whose
tool-call format (Hermes JSON, Qwen3-Coder XML, ...) the environment reads
(tg_jax.models.hf_dir). The job:
data -> RL arms (`pipeline.arms`: ("tg",) by default; "('grpo','tg')" to compare) from DIR's
weights -> held-out evaluation -> report in W/report, and each run's final policy exported
to W/export/<arm>_seed<s>/ (loadable by `AutoModelForCausalLM.from_pretrained`).

The architecture comes from DIR/config.json (model fields set here are checked against it);
the context is model.max_seq_len (default: config.json's max_position_embeddings), the
per-turn decode budgets rl_loop.max_new_tokens / eval.max_new_tokens.

TG is the library's recipe (tg_jax.rl.step_config.TGConfig's defaults): the forward KL at
lambda_tg 0.05, summed over the distilled tokens and divided by trajectories x 50 tokens. The
evidence for it comes from the embedded byte model (configs/default.py); it has not been
measured on a pretrained checkpoint. The bounded alternative, the JSD at lambda 1 over the
token mean: `--config.tg.kind=jsd --config.tg.normalize=token_mean --config.tg.lambda_tg=1`.

`configs/hf_tg.py:runlocal` shrinks steps, groups, rollouts and lengths so a tiny checkpoint
runs on a CPU in about two minutes (the tests use it); its task prompt alone describes the tools
(the template's tools block would not fit a tiny checkpoint's 512 positions).
"""

import ml_collections

from tg_jax import config_lib


def get_config(arg=None):
    if arg not in (None, "", "runlocal"):
        raise ValueError(f"configs/hf_tg.py takes no argument or 'runlocal', not {arg!r}")
    c = ml_collections.ConfigDict()
    c.stage = "pipeline"  # which stage tg_jax.main runs: data | pipeline | forward | eval
    c.seed = 0  # global seed (sampling)
    # Architecture from the checkpoint; run settings here: fp32 master weights, bf16 compute,
    # full remat (long agentic sequences), 8k-token context (student rows + hints).
    c.model = config_lib.hf_model_config(
        dtype="bfloat16", remat_policy="full", max_seq_len=8192 + 512
    )
    c.mesh = config_lib.mesh_config()  # FSDP over every device by default
    c.sampler_mesh = config_lib.sampler_mesh_config()  # sampler's own devices (0 = trainer's)
    c.tasks = config_lib.tasks_config()  # the embedded coding tasks
    # The tool-call protocol, in the model's own format; the tools described by its template.
    c.env = config_lib.env_config(requirements=("tool_json",), tools_in_prompt=True)
    c.rl = config_lib.rl_config(
        reward_weights=ml_collections.ConfigDict({"task": 1.0, "tool_json": 0.5}),
        micro_batches=8,
    )
    c.tg = config_lib.tg_config(chunk_size=512)  # the library's recipe (docstring)
    c.optim = config_lib.optim_config(lr=1e-6, total_steps=200)  # RL fine-tuning: small, flat
    c.rl_loop = config_lib.loop_config(
        steps=200, groups_per_step=16, rollouts_per_group=16, max_new_tokens=2048,
        seq_len=8192, length_multiple=512, checkpoint_every=10, eval_every=50,
    )  # fmt: skip
    c.eval = config_lib.eval_config(train_seeds=(0,), max_new_tokens=2048)
    c.pipeline = config_lib.pipeline_config(arms=("tg",))  # RL arms (tg_jax.train.pipeline.ARMS)
    if arg == "runlocal":
        c.model.update(dtype="float32", remat_policy="none", max_seq_len=None)
        c.tasks = config_lib.tasks_config(num_train=32, num_heldout=16)
        c.env = config_lib.env_config(requirements=("tool_json",), max_turns=2)
        c.rl.micro_batches = 1
        c.optim = config_lib.optim_config(lr=1e-4, total_steps=2)
        c.rl_loop = config_lib.tiny_loop_config(steps=2, max_new_tokens=16, eval_every=0)
        c.eval = config_lib.tiny_eval_config(max_new_tokens=16)
    return c
