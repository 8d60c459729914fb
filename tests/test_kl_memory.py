"""The chunked TG statistics must need far less temporary memory than full [B, T, V] logits."""

from tg_jax.bench import kl_memory


def test_chunked_kl_memory_ratio():
    # Compile only (shapes, never run). The full-size figure (V = 151,936, T = 8192) comes from
    # `python -m tg_jax.bench.kl_memory`; this smaller shape keeps the test quick.
    report = kl_memory.kl_memory_report(
        batch=1, length=1024, d_model=256, vocab=32_000, chunk_size=128
    )
    assert report.naive_temp_bytes > 4 * 1024 * 32_000 * 2  # at least two [T, V] fp32 arrays
    assert report.ratio < 0.25, report
