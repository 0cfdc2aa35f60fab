"""Time-sharing one device between the rollout engine and the training backend.

Every rank holds a training shard and a rollout engine on the same device. Per RL step:

    rollout -> engine.sleep(level)            weights offloaded (1) or discarded (2), KV cache freed
            -> backend.onload_training_state  optimizer state / gradient buffers back on the device
            -> train
            -> backend.offload_training_state what the rollout does not need leaves the device
            -> engine.wake_up(["weights"])    weight memory only: the KV cache stays free while
            -> reshard (engine.load_weights)  the fresh weights stream in
            -> engine.wake_up(["kv_cache"])   -> next rollout

On CPU hosts the two also share the cores: vLLM's CPU worker lowers torch's intra-op threads
for serving when the engine starts, which would leave training on one thread of a many-core
host; the threads are handed back to training before it runs and to the engine before it serves.
And they share the host heap: after each hand-over the heap's freed pages go back to the OS
(``trim_heap``), so one phase's fragments are not resident through the next.

``rollout.sleep_level=0`` keeps the engine resident (no sleep, no wake). vLLM's sleep mode is
GPU-only: on CPU the engine's sleep frees its KV cache itself and, at level 2, drops its CPU
kernels' packed weights and frees its parameters' memory (the reshard loads and packs the
fresh ones).
Where the backend cannot release memory (DeepSpeed's backend has no offload here), the calls
still happen and are counted and timed: the step's metrics say what ran.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

log = logging.getLogger("rhymerl.colocation")


class Colocation:
    """Drives the engine's sleep/wake and the backend's offload/onload; metrics per step."""

    def __init__(self, engine: Any, backend: Any, sleep_level: int, device_free_bytes: Optional[Callable[[], int]] = None,
                 cpu_threads: Optional[tuple[int, int]] = None, set_threads: Optional[Callable[[int], None]] = None,
                 trim_heap: Optional[Callable[[], Any]] = None):
        """``cpu_threads``: (training, rollout) intra-op thread counts, on CPU hosts. ``trim_heap``
        returns the host heap's freed pages to the OS after each hand-over (CPU hosts, where
        both sides' tensors live in that heap)."""
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level: {sleep_level} not allowed; allowed: 0, 1, 2")
        if cpu_threads is not None and set_threads is None:
            from rhymerl.devices import set_cpu_threads

            set_threads = set_cpu_threads
        self.cpu_threads = cpu_threads
        self._set_threads = set_threads
        self._trim_heap = trim_heap
        self.engine = engine
        self.backend = backend
        self.sleep_level = sleep_level
        self._free = device_free_bytes
        self._asleep = False
        self._trainer_offloaded = False
        self._m: dict[str, float] = {}

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        before = self._free() if self._free else None
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self._m[f"colocation/{name}_calls"] = self._m.get(f"colocation/{name}_calls", 0) + 1
        self._m[f"colocation/{name}_s"] = self._m.get(f"colocation/{name}_s", 0.0) + dt
        if before is not None:
            # Device bytes this call released (negative: took).
            self._m[f"colocation/{name}_freed_gb"] = (self._free() - before) / 1e9
        elif isinstance(out, int) and not isinstance(out, bool) and out:
            # No device figure (CPU hosts): the engine's own count of the bytes its sleep freed
            # (KV cache; at level 2 its parameters too) or its wake took back, and the resident
            # bytes the heap trims released.
            sign = 1 if name in ("engine_sleep", "heap_trim") else -1
            key = f"colocation/{name}_freed_gb"
            self._m[key] = self._m.get(key, 0.0) + sign * out / 1e9
        log.debug("colocation: %s in %.3f s", name, dt)
        return out

    # ------------------------------------------------------------------ phases

    def before_training(self) -> None:
        """The rollout is over: release the engine's memory, bring the training state back."""
        if self.cpu_threads is not None:
            self._set_threads(self.cpu_threads[0])
        if self.sleep_level and not self._asleep:
            self._timed("engine_sleep", lambda: self.engine.sleep(self.sleep_level))
            self._asleep = True
        if self._trainer_offloaded:
            self._timed("trainer_onload", self.backend.onload_training_state)
            self._trainer_offloaded = False
        self._trim()

    def after_training(self) -> None:
        """Training is over: free what the rollout does not need, wake the engine's weight memory."""
        if hasattr(self.backend, "offload_training_state"):
            self._timed("trainer_offload", self.backend.offload_training_state)
            self._trainer_offloaded = True
        if self._asleep:
            self._timed("engine_wake_weights", lambda: self.engine.wake_up(["weights"]))
        self._trim()

    def before_rollout(self) -> None:
        """The fresh weights are in: give the engine its KV cache back."""
        if self.cpu_threads is not None:
            self._set_threads(self.cpu_threads[1])
        if self._asleep:
            self._timed("engine_wake_kv", lambda: self.engine.wake_up(["kv_cache"]))
            self._asleep = False
        self._trim()

    def _trim(self) -> None:
        if self._trim_heap is not None:
            self._timed("heap_trim", self._trim_heap)

    def step_metrics(self) -> dict:
        """This step's counts and seconds (every key present each step, zero when not called)."""
        names = ("engine_sleep", "engine_wake_weights", "engine_wake_kv", "trainer_offload", "trainer_onload",
                 "heap_trim")
        out = {f"colocation/{n}_calls": 0 for n in names}
        out.update({f"colocation/{n}_s": 0.0 for n in names})
        out.update(self._m)
        self._m = {}
        return out
