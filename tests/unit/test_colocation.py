"""The colocation protocol's per-step calls and metrics (rhymerl.distributed.colocation)."""

from __future__ import annotations

import pytest

from rhymerl.distributed.colocation import Colocation

pytestmark = pytest.mark.cpu


class Recorder:
    """Engine and backend in one: records the calls the protocol makes."""

    def __init__(self, name: str = ""):
        self.calls: list[str] = []
        self.name = name

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self, tags=None):
        self.calls.append("wake:" + ",".join(tags or ["all"]))

    def offload_training_state(self):
        self.calls.append(f"offload{self.name}")

    def onload_training_state(self):
        self.calls.append(f"onload{self.name}")

    def reshard(self):
        self.calls.append("reshard")
        return {"time/reshard_s": 0.0}


def _started(engine, backend, **kw) -> Colocation:
    c = Colocation(backend, **kw)
    c.before_engine_build()
    c.attach_engine(engine)
    return c


def _steps(c: Colocation, r: Recorder, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        c.before_rollout(r.reshard)
        c.before_training()
        c.after_training()
        out.append(c.step_metrics())
    return out


def test_start_up_and_steps_follow_the_timeline():
    r = Recorder()
    c = Colocation(r, sleep_level=2)
    c.before_engine_build()
    # Training state leaves the device before the engine exists: vLLM's build sees it free.
    assert r.calls == ["offload"]
    c.attach_engine(r)
    assert r.calls == ["offload", "sleep2"]
    m = _steps(c, r, 2)
    assert r.calls == ["offload", "sleep2",
                       "wake:weights", "reshard", "wake:kv_cache", "sleep2", "onload", "offload",
                       "wake:weights", "reshard", "wake:kv_cache", "sleep2", "onload", "offload"]
    assert m[0]["colocation/engine_sleep_calls"] == 2 and m[0]["colocation/trainer_onload_calls"] == 1
    assert m[1]["colocation/engine_sleep_calls"] == 1 and m[1]["colocation/engine_wake_kv_calls"] == 1
    assert all(v >= 0 for v in m[1].values())


def test_the_first_rollout_serves_the_trainers_weights_and_runs_with_training_state_offloaded():
    """The engine's own load of the model files is never what the first rollout samples from
    (a resumed run's trainer holds the checkpoint's weights), and the rollout never finds the
    gradients and optimizer state on the device."""
    r = Recorder()
    c = _started(r, r, sleep_level=0)
    assert c.before_rollout(r.reshard) == {"time/reshard_s": 0.0}
    assert r.calls == ["offload", "reshard"]
    # Weights are fresh until the next training step.
    assert c.before_rollout(r.reshard) == {}
    c.before_training()
    c.after_training()
    c.before_rollout(r.reshard)
    assert r.calls == ["offload", "reshard", "onload", "offload", "reshard"]


def test_the_kl_reference_is_on_the_device_only_while_training():
    r, ref = Recorder(), Recorder("-ref")
    c = _started(r, r, sleep_level=1, references=[ref, None])
    _steps(c, r, 1)
    assert ref.calls == ["offload-ref", "onload-ref", "offload-ref"]


def test_a_rollout_before_the_engine_is_attached_is_refused():
    with pytest.raises(RuntimeError, match="attach_engine"):
        Colocation(Recorder(), sleep_level=1).before_rollout(dict)


def test_level_zero_keeps_the_engine_resident_and_metrics_keep_their_keys():
    r = Recorder()
    m = _steps(_started(r, r, sleep_level=0), r, 1)
    assert r.calls == ["offload", "reshard", "onload", "offload"]
    assert m[0]["colocation/engine_sleep_calls"] == 0 and "colocation/engine_wake_kv_s" in m[0]


def test_device_memory_released_is_reported_per_call():
    # before/after of each call, in bytes: start-up offload and sleep, then the step's
    # wake weights, wake kv, sleep, onload, offload.
    free = iter([10, 10, 10, 40, 40, 35, 35, 25, 25, 40, 40, 30, 30, 30])
    r = Recorder()
    c = _started(r, r, sleep_level=1, device_free_bytes=lambda: next(free) * 1e9)
    c.step_metrics()
    m = _steps(c, r, 1)[0]
    assert m["colocation/engine_sleep_freed_gb"] == 15 and m["colocation/engine_wake_kv_freed_gb"] == -10
    assert m["colocation/engine_wake_weights_freed_gb"] == -5


def test_without_a_device_figure_the_engines_own_count_is_reported():
    class CpuEngine(Recorder):  # what RolloutEngine.sleep/wake_up return on CPU: KV cache bytes
        def sleep(self, level):
            super().sleep(level)
            return 3 * 10**9

        def wake_up(self, tags=None):
            super().wake_up(tags)
            return 3 * 10**9 if "kv_cache" in tags else 0

    e = CpuEngine()
    c = _started(e, Recorder(), sleep_level=2)
    c.step_metrics()
    m = _steps(c, e, 1)[0]
    assert m["colocation/engine_sleep_freed_gb"] == 3 and m["colocation/engine_wake_kv_freed_gb"] == -3
    assert "colocation/engine_wake_weights_freed_gb" not in m


def test_bad_level_is_refused():
    with pytest.raises(ValueError, match="rollout.sleep_level"):
        Colocation(Recorder(), sleep_level=3)


def test_cpu_threads_go_to_training_then_back_to_the_engine():
    r = Recorder()
    c = Colocation(r, sleep_level=1, cpu_threads=(8, 1), set_threads=lambda n: r.calls.append(f"threads{n}"))
    c.before_engine_build()
    c.attach_engine(r)
    _steps(c, r, 1)
    assert r.calls == ["offload", "sleep1", "wake:weights", "reshard", "threads1", "wake:kv_cache",
                       "threads8", "sleep1", "onload", "offload"]


def test_host_heap_is_trimmed_after_every_hand_over_and_reported():
    r = Recorder()

    def trim():
        r.calls.append("trim")
        return 2_000_000  # resident bytes released

    c = _started(r, r, sleep_level=2, trim_heap=trim)
    assert r.calls == ["offload", "trim", "sleep2", "trim"]
    c.step_metrics()
    m = _steps(c, r, 1)[0]
    assert r.calls[4:] == ["wake:weights", "reshard", "wake:kv_cache", "trim", "sleep2", "onload", "trim",
                           "offload", "trim"]
    assert m["colocation/heap_trim_calls"] == 3
    assert m["colocation/heap_trim_freed_gb"] == pytest.approx(0.006)
    # Without a trimmer (GPU hosts) the key is still there, at zero.
    r2 = Recorder()
    assert _steps(_started(r2, r2, sleep_level=2), r2, 1)[0]["colocation/heap_trim_calls"] == 0


def test_host_heap_trimmer_releases_freed_pages_of_this_process():
    import ctypes

    from rhymerl.distributed.devices import host_heap_trimmer, resident_bytes

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
