"""Peak memory per run: independent of the runs before it in the same process."""

import mmap
import time

import numpy as np

from tg_jax.train import memory


class FakeProcess:
    """A process's memory: in use now, and the lifetime peak (which never goes down)."""

    def __init__(self, base=100):
        self.now = self.peak = base

    def set(self, now):
        self.now, self.peak = now, max(self.peak, now)

    def host(self):
        return self.now, self.peak

    def device(self):
        return {"bytes_in_use": self.now, "peak_bytes_in_use": self.peak}


def _run(proc, usage, *, device):
    """One 'arm': its memory goes through `usage`, sampled after each change."""
    kw = {"device_fn": proc.device} if device else {"host_fn": proc.host, "device_fn": dict}
    pm = memory.PeakMemory(interval_s=60.0, **kw).start()  # the test samples, not the thread
    for u in usage:
        proc.set(u)
        pm.sample()
    proc.set(100)  # the arm's arrays freed
    pm.stop()
    return pm.peak()


def test_peak_per_arm_does_not_depend_on_the_order():
    arms = {"big": [300, 900, 400], "small": [200, 350, 150]}
    for device in (False, True):
        source = "device" if device else "host_rss"
        for order in (("big", "small"), ("small", "big")):
            proc = FakeProcess()
            got = {arm: _run(proc, arms[arm], device=device) for arm in order}
            assert got == {"big": (900, source), "small": (350, source)}, (device, order)
    # What the process holds when a run starts is its baseline (peak - baseline: its own).
    proc = FakeProcess(base=400)
    pm = memory.PeakMemory(interval_s=60.0, host_fn=proc.host, device_fn=dict).start()
    proc.set(650)
    pm.stop()
    assert (pm.baseline, pm.peak()[0]) == (400, 650)


def test_a_new_record_between_samples_is_exact():
    # The sampler never saw 700 (a spike between samples), but the lifetime peak rose
    # during the run, so that record is this run's peak.
    proc = FakeProcess()
    pm = memory.PeakMemory(interval_s=60.0, host_fn=proc.host, device_fn=dict).start()
    proc.set(700)
    proc.set(200)
    assert pm.peak() == (700, "host_rss")
    pm.stop()
    # Under an earlier record, the sampled maximum (a lower bound for spikes) is reported.
    pm = memory.PeakMemory(interval_s=60.0, host_fn=proc.host, device_fn=dict).start()
    proc.set(300)
    pm.sample()
    proc.set(100)
    assert pm.peak() == (300, "host_rss")
    pm.stop()


def _touched_pages(nbytes):
    """Fresh anonymous pages, every one written: resident until closed, whatever malloc reuses."""
    buf = mmap.mmap(-1, nbytes)
    np.frombuffer(buf, dtype=np.uint8)[::4096] = 1
    return buf


def test_real_process_second_run_not_charged_with_the_first():
    with memory.PeakMemory(interval_s=0.01, device_fn=dict) as first:
        big = _touched_pages(200 * 2**20)
        time.sleep(0.1)
        first.sample()  # a reading while it is held, even if the thread was starved of CPU
        big.close()
    with memory.PeakMemory(interval_s=0.01, device_fn=dict) as second:
        small = _touched_pages(20 * 2**20)
        time.sleep(0.1)
        second.sample()
        small.close()
    above1 = first.peak()[0] - first.baseline
    above2 = second.peak()[0] - second.baseline
    assert above1 >= 150 * 2**20  # the first run saw its 200 MiB
    # ru_maxrss would charge the second run with the first's peak (about 200 MiB above).
    assert 10 * 2**20 <= above2 < 100 * 2**20


def test_resumed_run_keeps_the_max_over_sessions():
    from tg_jax.train import rl_costs

    proc = FakeProcess(base=200)
    session = rl_costs.Session(5, rl_costs.Costs(), 0.0, 0, peak0=(800, 300), started=0.0)
    session.memory = memory.PeakMemory(interval_s=60.0, host_fn=proc.host, device_fn=dict)
    with session.memory:
        proc.set(600)  # this session: peak 600, 400 above its start; the earlier one: 800, 300
        costs = session.stamp()
    assert (costs["peak_memory_bytes"], costs["peak_memory_above_start_bytes"]) == (800, 400)
    assert costs["peak_memory_source"] == "host_rss"
