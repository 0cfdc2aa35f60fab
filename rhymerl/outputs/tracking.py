"""W&B logging (rank 0, mirroring ``metrics.jsonl``) and console progress; neither may ever stop training."""

from __future__ import annotations

import logging
import math
import os
import secrets
import string
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

from rhymerl.launch.child_signals import shielded_start
from rhymerl.config import TrackingConfig
from rhymerl.outputs.wandb_store import logged_steps

# W&B flushes its transaction log every 15 s by default: a job killed within that window lost it all.
FLUSH_INTERVAL_S = 1.0
_ID_ALPHABET = string.ascii_lowercase + string.digits
log = logging.getLogger("rhymerl")


def _ranges(steps: Sequence[int]) -> str:
    """"0-4, 6" for [0, 1, 2, 3, 4, 6]."""
    out, start, prev = [], None, None
    for s in list(steps) + [None]:
        if start is not None and (s is None or s != prev + 1):
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if s is not None and start is None:
            start = s
        prev = s
    return ", ".join(out)


def new_run_id() -> str:
    """An id in W&B's own format (8 lowercase alphanumerics)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))


def _scalar(v: Any) -> Any:
    """Plain Python numbers for W&B (numpy/torch scalars and 0-d tensors included)."""
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        try:
            return v.item()
        except Exception:  # noqa: BLE001
            return v
    return v


HEADLINE = {  # metric -> short console label
    "epoch": "epoch", "reward/mean": "reward", "reward/accuracy": "acc", "response/len_mean": "len",
    "histospec/acceptance": "accept", "histospec/tokens_per_forward": "tok/fwd",
    "histospec/history_tokens_per_forward": "hist/fwd", "train/loss": "loss",
    "train/logprob_max_abs": "lp_diff", "time/rollout_s": "rollout_s", "time/train_s": "train_s",
    "time/step_s": "step_s"}


class ConsoleProgress:
    """One line per step (plain), a colourised line and a phase spinner (rich), or nothing."""

    def __init__(self, mode: str, enabled: bool = True, stream=None):
        self.mode = mode if enabled else "none"
        self.stream = stream or sys.stderr
        self._console = None
        if self.mode == "rich":
            try:
                from rich.console import Console

                self._console = Console(file=self.stream, highlight=False)
            except ImportError:
                self.mode = "plain"

    @contextmanager
    def phase(self, name: str, step: int) -> Iterator[None]:
        # The spinner redraws in place, which only makes sense on a terminal (not in a Slurm log).
        if self._console is not None and self._console.is_terminal:
            with self._console.status(f"step {step}: {name}..."):
                yield
        else:
            yield

    def step_line(self, step: int, metrics: Mapping[str, Any], phases: Mapping[str, float], max_steps: int = 0) -> None:
        if self.mode == "none":
            return
        shown = []
        keys = [k for k in HEADLINE if k in metrics] or list(metrics)
        for k in keys:
            v = _scalar(metrics[k])
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (k.startswith("time/") and k not in HEADLINE):
                continue
            shown.append(f"{HEADLINE.get(k, k)}={v:.4g}" if isinstance(v, float) else f"{HEADLINE.get(k, k)}={v}")
            if len(shown) == len(HEADLINE):
                break
        timing = " ".join(f"{k} {v:.2f}s" for k, v in phases.items())
        head = f"step {step}/{max_steps}" if max_steps else f"step {step}"
        if self._console is not None:
            self._console.print(f"[bold]{head}[/bold]  {'  '.join(shown)}  [dim]{timing}[/dim]")
        else:
            print(f"{head} | {' '.join(shown)} | {timing}", file=self.stream, flush=True)


class Tracker:
    """W&B run + console display for one training process (all calls are no-ops off rank 0)."""

    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config_dict: Mapping[str, Any],
                 rank: int = 0, resume_run_id: Optional[str] = None, *, max_steps: int = 0, console_stream=None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.max_steps = max_steps
        self.console = ConsoleProgress(cfg.console, enabled=rank == 0, stream=console_stream)
        self._phases: dict[str, float] = {}
        self._warned: set[str] = set()
        self._failures = 0
        self._run = None
        self._wandb = None
        self._last_step: Optional[int] = None
        self._pending_step: Optional[int] = None
        self._pending: dict[str, Any] = {}
        self._run_id: Optional[str] = None
        self._run_name, self._config = run_name, dict(config_dict)
        self._held: set[int] = set()  # steps W&B already holds: never sent again
        if rank != 0 or cfg.wandb == "disabled":
            self._run_id = resume_run_id
            return
        self._run_id = resume_run_id or new_run_id()
        self._init_wandb(run_name, config_dict, resume_run_id is not None)

    def _warn_once(self, what: str, err: BaseException) -> None:
        self._failures += 1
        if what in self._warned:
            return
        self._warned.add(what)
        warnings.warn(f"W&B {what} failed ({type(err).__name__}: {err}); training continues"
                      + (" without W&B" if what == "init" else ""), RuntimeWarning, stacklevel=3)

    def _init_wandb(self, run_name: str, config_dict: Mapping[str, Any], resuming: bool) -> None:
        wandb_dir = self.run_dir
        wandb_dir.mkdir(parents=True, exist_ok=True)
        # Keep wandb's cache and debug logs with the run, not piling up in ~/.cache/wandb.
        os.environ.setdefault("WANDB_CACHE_DIR", str(self.run_dir / "wandb-cache"))
        try:
            import wandb

            self._wandb = wandb
            # console="off": stdout/stderr already go to the Slurm log; wrapping them costs a thread.
            settings = wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL_S, init_timeout=60,
                                      console="off", silent=True)
            # wandb-core must outlive the job's USR1/TERM long enough for finish() to flush.
            with shielded_start():
                self._run = wandb.init(
                    project=self.cfg.project, entity=self.cfg.entity or None, name=run_name, id=self._run_id,
                    resume="allow" if resuming else None, mode=self.cfg.wandb, dir=str(wandb_dir),
                    config=dict(config_dict), settings=settings, reinit="create_new")
        except Exception as e:  # noqa: BLE001 - any W&B failure must leave training running
            self._run = None
            self._warn_once("init", e)

    @property
    def run_id(self) -> Optional[str]:
        """The W&B run id to store in the checkpoint (None when W&B is disabled)."""
        return self._run_id

    @property
    def active(self) -> bool:
        return self._run is not None

    @property
    def failures(self) -> int:
        """How many W&B calls failed (each kind is warned about once)."""
        return self._failures

    @property
    def run_path(self) -> Optional[Path]:
        """The folder W&B writes this process's data into (offline-run-*/ or run-*/)."""
        if self._run is None:
            return None
        try:
            return Path(self._run.dir).parent
        except Exception:  # noqa: BLE001
            return None

    def _call(self, what: str, fn, *args, **kwargs) -> None:
        if self._run is None:
            return
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self._warn_once(what, e)

    @contextmanager
    def phase(self, name: str, step: Optional[int] = None) -> Iterator[None]:
        """Time a phase, reported with the step's metrics; a phase of a new ``step`` commits the previous row."""
        if step is not None and self._pending_step is not None and step != self._pending_step:
            self._commit()
        t0 = time.perf_counter()
        with self.console.phase(name, step if step is not None else (self._last_step or 0) + 1):
            yield
        self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def _stage(self, step: int, data: Mapping[str, Any]) -> None:
        if self._pending_step is not None and step != self._pending_step:
            self._commit()
        if self._last_step is not None and step <= self._last_step:
            warnings.warn(f"tracking: step {step} logged after step {self._last_step} was committed; W&B drops it",
                          RuntimeWarning, stacklevel=3)
            return
        self._pending_step = step
        self._pending.update(data)

    def _commit(self) -> None:
        step, data = self._pending_step, self._pending
        self._pending_step, self._pending = None, {}
        if step is None:
            return
        self._last_step = step
        if self._run is not None and step not in self._held:
            self._call("log", self._run.log, data, step=step, commit=True)

    def flush(self) -> None:
        """Commit the current step's row now (else the next step or ``finish()`` does, and a kill loses it)."""
        self._commit()

    def log(self, step: int, metrics: Mapping[str, Any], *, commit: bool = False) -> None:
        """Log one step's metrics plus the phase times gathered since the last call (any order per step)."""
        phases, self._phases = self._phases, {}
        if self.rank != 0:
            return
        data = {k: _scalar(v) for k, v in metrics.items()}
        for name, secs in phases.items():
            data[f"time/{name}_s"] = secs
        if phases:
            data["time/step_s"] = sum(phases.values())
        self._stage(step, data)
        if commit:
            self._commit()
        self.console.step_line(step, metrics, phases, self.max_steps)

    def log_lengths(self, step: int, lengths: Sequence[int], name: str = "rollout/response_length") -> None:
        """Histogram of response lengths (tokens) plus their mean/max/p90 as scalars."""
        if self.rank != 0 or not lengths:
            return
        vals = sorted(int(x) for x in lengths)
        stats: dict[str, Any] = {f"{name}_mean": sum(vals) / len(vals), f"{name}_max": vals[-1],
                                 f"{name}_p90": vals[min(len(vals) - 1, math.ceil(0.9 * len(vals)) - 1)]}
        if self._run is not None:
            try:
                stats[f"{name}_hist"] = self._wandb.Histogram(vals, num_bins=min(64, max(1, len(set(vals)))))
            except Exception as e:  # noqa: BLE001
                self._warn_once("histogram", e)
        self._stage(step, stats)

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]], name: str = "samples") -> bool:
        """A table of sample responses every ``log_samples_every`` steps; True if staged."""
        every = self.cfg.log_samples_every
        if self.rank != 0 or self._run is None or every <= 0 or step % every != 0 or not rows:
            return False
        columns = ["step"] + list(rows[0].keys())
        try:
            table = self._wandb.Table(columns=columns,
                                      data=[[step] + [_scalar(r.get(c)) for c in columns[1:]] for r in rows])
        except Exception as e:  # noqa: BLE001
            self._warn_once("table", e)
            return False
        self._stage(step, {name: table})
        return True

    def summary(self, values: Mapping[str, Any]) -> None:
        if self.rank != 0 or self._run is None:
            return
        try:
            for k, v in values.items():
                self._run.summary[k] = _scalar(v)
        except Exception as e:  # noqa: BLE001
            self._warn_once("summary", e)

    def finish(self, exit_code: int = 0) -> bool:
        """Flush and close the W&B run (not from a signal handler); False when W&B could not finish it."""
        self._commit()
        run, self._run = self._run, None
        if run is None:
            return True
        ok = True
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:  # noqa: BLE001
            ok = False
            self._warn_once("finish", e)
        try:
            # Close wandb-core now: after a SIGTERM ended it, exit-time teardown would print a traceback.
            self._wandb.teardown()
        except Exception as e:  # noqa: BLE001
            ok = False
            self._warn_once("finish", e)
        return ok

    def _wandb_steps(self) -> Optional[set[int]]:
        """The steps this run's W&B files hold (None: unreadable, or W&B off)."""
        if self.rank != 0 or self.cfg.wandb == "disabled" or self._run_id is None:
            return None
        steps = logged_steps(self.run_dir / "wandb", self._run_id)
        if steps is None:
            warnings.warn(f"tracking: cannot read W&B's files of run {self._run_id} under {self.run_dir / 'wandb'}; "
                          "steps it lost are not logged again, and steps it holds may be logged twice",
                          RuntimeWarning, stacklevel=3)
        return steps

    def catch_up(self, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        """At a resume: log the rows W&B lacks, hold back those it has that this run repeats; the steps logged."""
        if self._run is None:
            return []
        have = self._wandb_steps()
        if have is None:
            return []
        try:
            # Online, the server's run goes on from starting_step: anything before it is there already.
            have |= set(range(int(getattr(self._run, "starting_step", 0) or 0)))
        except (TypeError, ValueError):
            pass
        logged = self._log_rows([r for r in rows if r.get("step") not in have])
        last_row = max((int(r["step"]) for r in rows), default=-1)
        self._held = {s for s in have if s > last_row}
        if self._held:
            log.warning("tracking: W&B run %s already holds step(s) %s, which this run repeats from its "
                        "checkpoint: they are not logged again", self._run_id, _ranges(sorted(self._held)))
        return logged

    def repair(self, rows: Sequence[Mapping[str, Any]], exit_code: int = 0) -> list[int]:
        """Finish the run, log the ``metrics.jsonl`` rows W&B lost through a fresh W&B process, finish again."""
        self.finish(exit_code)
        if self.rank != 0 or self.cfg.wandb == "disabled" or self._wandb is None:
            return []
        have = self._wandb_steps()
        if have is None:
            return []
        missing = [r for r in rows if r.get("step") not in have]
        if not missing:
            return []
        self._init_wandb(self._run_name, self._config, resuming=True)
        self._last_step = None  # a new W&B process: its own step order starts here
        logged = self._log_rows(missing)
        self.finish(exit_code)
        return logged

    def _log_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        done = []
        for row in sorted(rows, key=lambda r: r["step"]):
            step = int(row["step"])
            if self._run is None or (self._last_step is not None and step <= self._last_step):
                continue
            self._call("log", self._run.log, {k: _scalar(v) for k, v in row.items() if k != "step"}, step=step,
                       commit=True)
            self._last_step = step
            done.append(step)
        if done:
            log.warning("tracking: W&B run %s lacked step(s) %s of metrics.jsonl; logged them from it",
                        self._run_id, _ranges(done))
        return done

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_code=0 if exc_type is None else 1)
