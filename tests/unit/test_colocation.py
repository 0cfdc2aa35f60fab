"""The colocation protocol's per-step calls and metrics (rhymerl.colocation)."""

from __future__ import annotations

import pytest

from rhymerl.colocation import Colocation

pytestmark = pytest.mark.cpu


class Recorder:
    """Engine and backend in one: records the calls the protocol makes."""

    def __init__(self):
        self.calls: list[str] = []

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake:" + ",".join(tags or ["all"]))

    def offload_training_state(self):
        self.calls.append("offload")

    def onload_training_state(self):
        self.calls.append("onload")


def _steps(c: Colocation, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        c.before_training()
        c.after_training()
        c.before_rollout()
        out.append(c.step_metrics())
    return out


def test_sleep_offload_wake_order_over_steps():
    r = Recorder()
    m = _steps(Colocation(r, r, sleep_level=2), 2)
    assert r.calls == ["sleep2", "offload", "wake:weights", "wake:kv_cache",
                       "sleep2", "onload", "offload", "wake:weights", "wake:kv_cache"]
    assert m[0]["colocation/engine_sleep_calls"] == 1 and m[0]["colocation/trainer_onload_calls"] == 0
    assert m[1]["colocation/trainer_onload_calls"] == 1 and m[1]["colocation/engine_wake_kv_calls"] == 1
    assert all(v >= 0 for v in m[1].values())


def test_level_zero_keeps_the_engine_resident_and_metrics_keep_their_keys():
    r = Recorder()
    m = _steps(Colocation(r, r, sleep_level=0), 1)
    assert r.calls == ["offload"]
    assert m[0]["colocation/engine_sleep_calls"] == 0 and "colocation/engine_wake_kv_s" in m[0]


def test_device_memory_released_is_reported_per_call():
    free = iter([10, 30, 30, 25, 25, 20, 20, 10])  # before/after of each call, in bytes
    r = Recorder()
    c = Colocation(r, r, sleep_level=1, device_free_bytes=lambda: next(free) * 1e9)
    m = _steps(c, 1)[0]
    assert m["colocation/engine_sleep_freed_gb"] == 20 and m["colocation/engine_wake_kv_freed_gb"] == -10


def test_without_a_device_figure_the_engines_own_count_is_reported():
    class CpuEngine(Recorder):  # what RolloutEngine.sleep/wake_up return on CPU: KV cache bytes
        def sleep(self, level):
            super().sleep(level)
            return 3 * 10**9

        def wake_up(self, tags=None):
            super().wake_up(tags)
            return 3 * 10**9 if "kv_cache" in tags else 0

    e = CpuEngine()
    m = _steps(Colocation(e, Recorder(), sleep_level=2), 1)[0]
    assert m["colocation/engine_sleep_freed_gb"] == 3 and m["colocation/engine_wake_kv_freed_gb"] == -3
    assert "colocation/engine_wake_weights_freed_gb" not in m


def test_bad_level_is_refused():
    with pytest.raises(ValueError, match="rollout.sleep_level"):
        Colocation(Recorder(), Recorder(), sleep_level=3)


def test_cpu_threads_go_to_training_then_back_to_the_engine():
    r = Recorder()
    c = Colocation(r, r, sleep_level=1, cpu_threads=(8, 1), set_threads=lambda n: r.calls.append(f"threads{n}"))
    _steps(c, 1)
    assert r.calls == ["threads8", "sleep1", "offload", "wake:weights", "threads1", "wake:kv_cache"]


def test_host_heap_is_trimmed_after_every_hand_over_and_reported():
    r = Recorder()

    def trim():
        r.calls.append("trim")
        return 2_000_000  # resident bytes released

    m = _steps(Colocation(r, r, sleep_level=2, trim_heap=trim), 1)[0]
    assert r.calls == ["sleep2", "trim", "offload", "wake:weights", "trim", "wake:kv_cache", "trim"]
    assert m["colocation/heap_trim_calls"] == 3
    assert m["colocation/heap_trim_freed_gb"] == pytest.approx(0.006)
    # Without a trimmer (GPU hosts) the key is still there, at zero.
    assert _steps(Colocation(r, r, sleep_level=2), 1)[0]["colocation/heap_trim_calls"] == 0


def test_host_heap_trimmer_releases_freed_pages_of_this_process():
    import ctypes

    from rhymerl.devices import host_heap_trimmer, resident_bytes

    trim = host_heap_trimmer()
    if trim is None:
        pytest.skip("this C library has no malloc_trim")
    # Many 64 KB blocks, below glibc's mmap threshold: they come from the heap, and freeing them
    # leaves their pages resident until a trim.
    blocks = [ctypes.create_string_buffer(64 << 10) for _ in range(1024)]
    for b in blocks:
        ctypes.memset(b, 1, len(b))
    keep = ctypes.create_string_buffer(16)  # above them: the heap's top cannot shrink past it
    del blocks
    before = resident_bytes()
    released = trim()
    assert released > 16 << 20
    assert resident_bytes() < before
    del keep
