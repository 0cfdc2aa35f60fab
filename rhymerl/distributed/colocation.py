"""Time-sharing one device between the rollout engine and the training backend.

Every rank holds a training shard and a rollout engine on the same device. The timeline:

    build the policy (and the KL reference)
    -> before_engine_build      gradients, optimizer state and the reference leave the device
    -> build the engine         vLLM asks for gpu_memory_utilization x total of *free* memory
    -> attach_engine            the engine sleeps at once (weights and KV cache released)
    per step:
    -> before_rollout(reshard)  engine.wake_up(["weights"]), the trainer's weights stream in,
                                engine.wake_up(["kv_cache"])
    -> rollout
    -> before_training          engine.sleep(level); training state (and reference) come back
    -> train
    -> after_training           training state (and reference) leave the device; the engine's
                                weights are now stale

So the engine always serves the trainer's current weights (the first rollout's come from the
trainer too, which is also what a resumed run needs), and no phase ever holds the training
state and the engine's share at once. verl orders its colocated start-up the same way.

On CPU hosts the two also share the cores: vLLM's CPU worker lowers torch's intra-op threads
for serving when the engine starts, which would leave training on one thread of a many-core
host; the threads are handed back to training before it runs and to the engine before it serves.
And they share the host heap: after each hand-over the heap's freed pages go back to the OS
(``trim_heap``), so one phase's fragments are not resident through the next.

``rollout.sleep_level=0`` keeps the engine resident (no sleep, no wake). vLLM's sleep mode is
GPU-only: on CPU the engine's sleep frees its KV cache itself and, at level 2, drops its CPU
kernels' packed weights and frees its parameters' memory (the reshard loads and packs the
fresh ones).
Where a backend cannot release memory (DeepSpeed's backend has no offload here), the calls
still happen and are counted and timed: the step's metrics say what ran.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

log = logging.getLogger("rhymerl.distributed.colocation")

PHASE_CALLS = ("engine_sleep", "engine_wake_weights", "engine_wake_kv", "trainer_offload", "trainer_onload",
               "heap_trim")


class Colocation:
    """Drives the engine's sleep/wake and the backends' offload/onload; metrics per step."""

    def __init__(self, backend: Any, sleep_level: int, references: Sequence[Any] = (),
                 device_free_bytes: Optional[Callable[[], int]] = None,
                 cpu_threads: Optional[tuple[int, int]] = None, set_threads: Optional[Callable[[int], None]] = None,
                 trim_heap: Optional[Callable[[], Any]] = None):
        """``references``: frozen backends used only while training (the KL reference).
        ``cpu_threads``: (training, rollout) intra-op thread counts, on CPU hosts. ``trim_heap``
        returns the host heap's freed pages to the OS after each hand-over (CPU hosts, where
        both sides' tensors live in that heap)."""
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level: {sleep_level} not allowed; allowed: 0, 1, 2")
        if cpu_threads is not None and set_threads is None:
            from rhymerl.distributed.devices import set_cpu_threads

            set_threads = set_cpu_threads
        self.cpu_threads = cpu_threads
        self._set_threads = set_threads
        self._trim_heap = trim_heap
        self.engine: Any = None
        self.backends = [backend, *[r for r in references if r is not None]]
        self.sleep_level = sleep_level
        self._free = device_free_bytes
        self._asleep = False
        self._trainer_offloaded = False
        # The engine serves weights other than the trainer's (built from the model files, or
        # the trainer has stepped since): the next rollout reshards first.
        self.weights_stale = True
        self._m: dict[str, float] = {}

    def share_cpu_threads(self, training: int, rollout: int) -> None:
        """From now on, hand torch's intra-op threads to training and to the engine at each hand-over."""
        if training == rollout:
            return
        if self._set_threads is None:
            from rhymerl.distributed.devices import set_cpu_threads

            self._set_threads = set_cpu_threads
        self.cpu_threads = (training, rollout)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        before = self._free() if self._free else None
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self._m[f"colocation/{name}_calls"] = self._m.get(f"colocation/{name}_calls", 0) + 1
        self._m[f"colocation/{name}_s"] = self._m.get(f"colocation/{name}_s", 0.0) + dt
        if before is not None:
            # Device bytes this call released (negative: took).
            key = f"colocation/{name}_freed_gb"
            self._m[key] = self._m.get(key, 0.0) + (self._free() - before) / 1e9
        elif isinstance(out, int) and not isinstance(out, bool) and out:
            # No device figure (CPU hosts): the engine's own count of the bytes its sleep freed
            # (KV cache; at level 2 its parameters too) or its wake took back, and the resident
            # bytes the heap trims released.
            sign = 1 if name in ("engine_sleep", "heap_trim") else -1
            key = f"colocation/{name}_freed_gb"
            self._m[key] = self._m.get(key, 0.0) + sign * out / 1e9
        log.debug("colocation: %s in %.3f s", name, dt)
        return out

    def _offload_trainer(self) -> None:
        for b in self.backends:
            if hasattr(b, "offload_training_state"):
                self._timed("trainer_offload", b.offload_training_state)
        self._trainer_offloaded = True

    def _onload_trainer(self) -> None:
        for b in self.backends:
            if hasattr(b, "onload_training_state"):
                self._timed("trainer_onload", b.onload_training_state)
        self._trainer_offloaded = False

    # ------------------------------------------------------------------ start-up

    def before_engine_build(self) -> None:
        """Free what the engine's build must find free: everything training alone needs."""
        self._offload_trainer()
        self._trim()

    def attach_engine(self, engine: Any) -> None:
        """The engine is built: it sleeps until the first rollout wakes it with the trainer's weights."""
        self.engine = engine
        if self.sleep_level:
            self._timed("engine_sleep", lambda: engine.sleep(self.sleep_level))
            self._asleep = True
        self._trim()

    # ------------------------------------------------------------------ phases

    def before_rollout(self, reshard: Callable[[], dict]) -> dict:
        """Make the engine serve the trainer's current weights with its KV cache in place;
        returns ``reshard``'s figures when it ran."""
        if self.engine is None:
            raise RuntimeError("colocation: attach_engine() must run before the first rollout")
        if not self._trainer_offloaded:
            self._offload_trainer()
        out: dict = {}
        if self.weights_stale:
            if self._asleep:
                # Weight memory only: the KV cache stays free while the fresh weights stream in.
                self._timed("engine_wake_weights", lambda: self.engine.wake_up(["weights"]))
            out = reshard()
            self.weights_stale = False
        if self.cpu_threads is not None:
            self._set_threads(self.cpu_threads[1])
        if self._asleep:
            self._timed("engine_wake_kv", lambda: self.engine.wake_up(["kv_cache"]))
            self._asleep = False
        self._trim()
        return out

    def before_training(self) -> None:
        """The rollout is over: release the engine's memory, bring the training state back."""
        if self.cpu_threads is not None:
            self._set_threads(self.cpu_threads[0])
        if self.sleep_level and not self._asleep:
            self._timed("engine_sleep", lambda: self.engine.sleep(self.sleep_level))
            self._asleep = True
        if self._trainer_offloaded:
            self._onload_trainer()
        self._trim()

    def after_training(self) -> None:
        """Training is over: free what the rollout does not need; the engine's weights are stale."""
        self._offload_trainer()
        self.weights_stale = True
        self._trim()

    def _trim(self) -> None:
        if self._trim_heap is not None:
            self._timed("heap_trim", self._trim_heap)

    def step_metrics(self) -> dict:
        """This step's counts and seconds (every key present each step, zero when not called)."""
        out = {f"colocation/{n}_calls": 0 for n in PHASE_CALLS}
        out.update({f"colocation/{n}_s": 0.0 for n in PHASE_CALLS})
        out.update(self._m)
        self._m = {}
        return out
