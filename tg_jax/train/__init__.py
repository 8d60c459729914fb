"""Training stages: SFT of the base model (sft, sft_data, sft_eval) and the RL loop.

Their config sections live in tg_jax.config_lib.
"""
