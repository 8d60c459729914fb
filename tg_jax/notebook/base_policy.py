"""The base policy to explore: a workdir's finished SFT checkpoint, or a fresh initialisation.

Notebooks call `load_base_policy(config, workdir)`; without a workdir (tests, a first look) the
model of `config.model` is randomly initialised, which exercises every code path in seconds but
samples bytes at random.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tg_jax.models import ModelConfig, Transformer, init_params


@dataclasses.dataclass
class BasePolicy:
    """A model and its params.

    Attributes:
      model: the Transformer of `config.model`.
      params: its params (on the devices given to `load_base_policy`).
      source: where the params come from, in words.
    """

    model: Transformer
    params: Any
    source: str

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(x.shape) for x in jax.tree.leaves(self.params)))


def load_base_policy(
    config: Any,
    workdir: str | None = None,
    *,
    seed: int = 0,
    devices: Sequence[jax.Device] | None = None,
) -> BasePolicy:
    """The SFT base model of `workdir`, or a random initialisation when no workdir is given.

    Args:
      config: the config the workdir was made with (sections model, mesh, sft).
      workdir: a workdir after the `sft` stage; None or "" = random init.
      seed: init seed (random init only).
      devices: devices of the mesh the params are placed on (default: the first device only,
        which is what a notebook's sampler wants for the embedded default model).

    Returns:
      The BasePolicy.

    Raises:
      FileNotFoundError: `workdir` holds no finished SFT checkpoint for this config.
    """
    if not workdir:
        model = Transformer(ModelConfig.from_config(config.model))
        params = init_params(model, jax.random.key(seed))
        return BasePolicy(model, params, f"random init (seed {seed}): no workdir given")
    # Checkpoint reading (orbax) only when there is a checkpoint to read.
    from tg_jax import sharding  # noqa: PLC0415
    from tg_jax.train import sft  # noqa: PLC0415

    if not sft.sft_finished(config, workdir):
        raise FileNotFoundError(
            f"{workdir} holds no finished SFT checkpoint (step {config.sft.steps}) in "
            f"{sft.sft_checkpoint_dir(workdir)}: run the sft stage with this config first"
        )
    config = sft.tokenized_config(config, sft.sft_tokenizer(config, workdir))  # BPE: its vocab
    model = Transformer(ModelConfig.from_config(config.model))
    mesh = sharding.make_mesh(config.mesh, devices=list(devices or jax.devices()[:1]))
    state = sft.load_sft_state(config, workdir, model, mesh, sharding.logical_rules(config.mesh))
    source = f"SFT checkpoint step {int(state.step)} of {sft.sft_checkpoint_dir(workdir)}"
    return BasePolicy(model, state.params, source)
