"""Training stages: SFT of the base model (sft, sft_data, sft_eval) and the RL loop.

stage_configs.py and rl_config.py hold the config sections of these stages.
"""
