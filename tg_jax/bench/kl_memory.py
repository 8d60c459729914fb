"""Compile-time memory check: chunked TG statistics vs the naive full-[B, T, V] computation.

Both variants compute the value and gradient (w.r.t. the student hidden states and the
unembedding matrix) of sum(target log-probs) + sum(entropies) + sum(D_t), with the teacher's
hidden states as a stop-gradient input. Nothing is run: each is lowered from
ShapeDtypeStructs, compiled, and `memory_analysis().temp_size_in_bytes` is read (buffers that
live only inside the step, excluding arguments and outputs). Run the full-size check with

    JAX_PLATFORMS=cpu .venv/bin/python -m tg_jax.bench.kl_memory

(Qwen3 vocabulary V = 151,936, T = 8192, B = 1, D = 2048, C = 512; acceptance: chunked <= 10%
of naive).
"""

import argparse
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from tg_jax import tracing
from tg_jax.rl.step_config import DIVERGENCES, TGConfig
from tg_jax.rl.tg import divergence as tg_loss


class MemoryReport(NamedTuple):
    """Temporary-buffer sizes of the two compiled value-and-grad functions.

    Attributes:
      chunked_temp_bytes: temp bytes of the chunked, rematerialised version.
      naive_temp_bytes: temp bytes of the version that builds [B, T, V] logits.
      ratio: chunked / naive.
    """

    chunked_temp_bytes: int
    naive_temp_bytes: int
    ratio: float


def _unembed(hidden_BxCxD: jax.Array, w_DxV: jax.Array) -> jax.Array:
    return jnp.einsum("bcd,dv->bcv", hidden_BxCxD, w_DxV, preferred_element_type=jnp.float32)


def _chunked_objective(
    hidden_BxTxD: jax.Array,
    w_DxV: jax.Array,
    teacher_BxTxD: jax.Array,
    targets_BxT: jax.Array,
    *,
    chunk_size: int,
    kind: tg_loss.DivergenceKind,
) -> jax.Array:
    stats = tg_loss.chunked_token_stats(
        hidden_BxTxD,
        targets_BxT,
        functools.partial(_unembed, w_DxV=w_DxV),
        teacher_hidden_BxTxD=teacher_BxTxD,
        chunk_size=chunk_size,
        kind=kind,
    )
    return stats.logprob_BxT.sum() + stats.entropy_BxT.sum() + stats.divergence_BxT.sum()


def _naive_objective(
    hidden_BxTxD: jax.Array,
    w_DxV: jax.Array,
    teacher_BxTxD: jax.Array,
    targets_BxT: jax.Array,
    *,
    kind: tg_loss.DivergenceKind,
) -> jax.Array:
    logits_BxTxV = _unembed(hidden_BxTxD, w_DxV)
    teacher_logits_BxTxV = jax.lax.stop_gradient(_unembed(teacher_BxTxD, w_DxV))
    log_p_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    logprob_BxT = jnp.take_along_axis(log_p_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    entropy_BxT = -jnp.sum(jnp.exp(log_p_BxTxV) * log_p_BxTxV, axis=-1)
    div_BxT = tg_loss.token_divergence(logits_BxTxV, teacher_logits_BxTxV, kind=kind)
    return logprob_BxT.sum() + entropy_BxT.sum() + div_BxT.sum()


def _temp_bytes(objective, shapes: tuple[jax.ShapeDtypeStruct, ...]) -> int:
    fn = tracing.jit(jax.value_and_grad(objective, argnums=(0, 1)))
    return int(fn.lower(*shapes).compile().memory_analysis().temp_size_in_bytes)


def kl_memory_report(
    *,
    batch: int = 1,
    length: int = 8192,
    d_model: int = 2048,
    vocab: int = 151_936,
    chunk_size: int = 512,
    dtype: jnp.dtype = jnp.bfloat16,
    kind: tg_loss.DivergenceKind = TGConfig.kind,
) -> MemoryReport:
    """Compiles (never runs) both versions for the given shapes and compares temp memory.

    Args:
      batch, length, d_model, vocab: B, T, D, V.
      chunk_size: C for the chunked version.
      dtype: dtype of hidden states and unembedding (logits are fp32 either way).
      kind: divergence kind (default: tg.kind's).

    Returns:
      `MemoryReport`.
    """
    shapes = (
        jax.ShapeDtypeStruct((batch, length, d_model), dtype),
        jax.ShapeDtypeStruct((d_model, vocab), dtype),
        jax.ShapeDtypeStruct((batch, length, d_model), dtype),
        jax.ShapeDtypeStruct((batch, length), jnp.int32),
    )
    chunked = _temp_bytes(
        functools.partial(_chunked_objective, chunk_size=chunk_size, kind=kind), shapes
    )
    naive = _temp_bytes(functools.partial(_naive_objective, kind=kind), shapes)
    return MemoryReport(chunked, naive, chunked / naive)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--d_model", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--chunk_size", type=int, default=512)
    parser.add_argument("--kind", default=TGConfig.kind, choices=DIVERGENCES)
    args = parser.parse_args()
    report = kl_memory_report(
        batch=args.batch,
        length=args.length,
        d_model=args.d_model,
        vocab=args.vocab,
        chunk_size=args.chunk_size,
        kind=args.kind,
    )
    gib = 1024**3
    print(
        f"B={args.batch} T={args.length} D={args.d_model} V={args.vocab} C={args.chunk_size} "
        f"kind={args.kind} backend={jax.default_backend()}\n"
        f"chunked temp: {report.chunked_temp_bytes / gib:.3f} GiB\n"
        f"naive temp:   {report.naive_temp_bytes / gib:.3f} GiB\n"
        f"ratio:        {report.ratio:.4f}"
    )


if __name__ == "__main__":
    main()
