"""Time-sharing one device between the rollout engine and training: no phase holds both."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from rhymerl.distributed.devices import set_cpu_threads

log = logging.getLogger("rhymerl.distributed.colocation")

PHASE_CALLS = ("engine_sleep", "engine_wake_weights", "engine_wake_kv", "trainer_offload", "trainer_onload",
               "heap_trim")


class Colocation:
    """Drives the engine's sleep/wake and the backends' offload/onload; metrics per step."""

    def __init__(self, backend: Any, sleep_level: int, references: Sequence[Any] = (),
                 device_free_bytes: Optional[Callable[[], int]] = None,
                 cpu_threads: Optional[tuple[int, int]] = None, set_threads: Optional[Callable[[int], None]] = None,
                 trim_heap: Optional[Callable[[], Any]] = None):
        """``references``: frozen backends used while training; ``cpu_threads``: (training, rollout) threads."""
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"rollout.sleep_level: {sleep_level} not allowed; allowed: 0, 1, 2")
        if cpu_threads is not None and set_threads is None:
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
        self.weights_stale = True  # the engine's weights differ from the trainer's: reshard first
        self._m: dict[str, float] = {}

    def share_cpu_threads(self, training: int, rollout: int) -> None:
        """From now on, hand torch's intra-op threads to training and to the engine at each hand-over."""
        if training == rollout:
            return
        if self._set_threads is None:
            self._set_threads = set_cpu_threads
        self.cpu_threads = (training, rollout)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        before = self._free() if self._free else None
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        self._m[f"colocation/{name}_calls"] = self._m.get(f"colocation/{name}_calls", 0) + 1
        self._m[f"colocation/{name}_s"] = self._m.get(f"colocation/{name}_s", 0.0) + dt
        if before is not None:  # device bytes released (negative: taken)
            key = f"colocation/{name}_freed_gb"
            self._m[key] = self._m.get(key, 0.0) + (self._free() - before) / 1e9
        elif isinstance(out, int) and not isinstance(out, bool) and out:
            # CPU hosts: the bytes the call itself reports freed (sleep, trim) or taken (wake).
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

    def before_rollout(self, reshard: Callable[[], dict]) -> dict:
        """Make the engine serve the trainer's current weights; returns ``reshard``'s figures when it ran."""
        if self.engine is None:
            raise RuntimeError("colocation: attach_engine() must run before the first rollout")
        if not self._trainer_offloaded:
            self._offload_trainer()
        out: dict = {}
        if self.weights_stale:
            if self._asleep:  # weights only: the KV cache stays free while they stream in
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
