"""The run driver: process groups -> trainer -> steps, with resume, tracking and preemption."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from rhymerl.config import ConfigError, RunConfig, load_config, to_dict
from rhymerl.outputs.atomic import atomic_write_text

# torch, vLLM and the trainer load inside functions: the preemption handler is installed before them.

log = logging.getLogger("rhymerl")


def launcher_env() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun's or Slurm's environment; (0, 1, 0) otherwise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_LOCALID", 0))
    return 0, 1, 0


def _seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


class StepLog:
    """A JSONL file of per-step rows in the run folder, cut back to the resume point on resume."""

    def __init__(self, path: Path, resume_step: int, enabled: bool):
        self.path = path
        self.enabled = enabled
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        keep, dropped = [], 0
        if path.is_file() and resume_step == 0 and path.stat().st_size:
            # A fresh start never erases an earlier run's rows: they move aside, with a message.
            aside = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            log.warning("%s holds rows of an earlier run; moved them to %s", path, aside.name)
        elif path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < resume_step:
                        keep.append(line)
                        continue
                except (json.JSONDecodeError, KeyError, TypeError):
                    pass
                dropped += 1
            if dropped:
                log.warning("%s: dropped %d row(s) of steps >= %d (or unreadable), which ran after the checkpoint "
                            "and run again now", path, dropped, resume_step)
        atomic_write_text(path, "".join(k + "\n" for k in keep))

    def rows(self) -> list[dict]:
        """The file's rows (none when disabled: not rank 0)."""
        if not self.enabled or not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def append(self, step: int, rows: list[dict]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write("".join(json.dumps({"step": step, **r}) + "\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())


# What the stop line says of the job, by rhymerl.launch.preemption.requeued_by_slurm's answer.
REQUEUE_WORDS = {True: "job requeued by Slurm", False: "job not requeued",
                 None: "Slurm did not say whether it requeues the job"}


def _plain_metrics(metrics: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool)) or v is None else float(v)) for k, v in metrics.items()}


def _trace_rows(trainer, out) -> list[dict]:
    """One rhymerl.outputs.traces row per response of the step."""
    recs = trainer.last_batch_records
    return [{"prompt_id": recs[s.group].id, "epoch": out.epoch, "sample_idx": s.sample_idx, "token_ids": s.token_ids,
             "logprobs": s.logprobs, "reward": s.reward, "prompt_token_ids": s.prompt_ids} for s in out.samples]


def run(cfg: RunConfig, rank: int = 0, world_size: int = 1, preempt=None) -> int:
    """``preempt``: the caller's PreemptionHandler, installed as early as possible (else one here). A rank's
    death ends every surviving rank with a line naming it (``PeerWatch``)."""
    from rhymerl.launch.preemption import PreemptionHandler
    from rhymerl.distributed.peer_watch import DIAGNOSE_S, PeerWatch
    from rhymerl.distributed.process_groups import init_process_groups, world_comm

    preempt = preempt if preempt is not None else PreemptionHandler()
    _seed_everything(cfg.run.seed + rank)
    groups = init_process_groups(cfg.parallel, world_size, rank)
    watch = PeerWatch.from_env(rank, world_size)
    where = {"at": "while the run started"}
    try:
        return _train(cfg, rank, world_size, preempt, groups, world_comm(groups), where)
    except Exception as e:
        lost = watch.explain(e, where["at"]) if watch is not None else None
        if lost is not None:
            raise lost from e
        raise
    finally:
        if watch is not None:
            # Rank 0 holds the store the others read to name the dead: it leaves after them.
            linger = DIAGNOSE_S + 2 if watch.lost and rank == 0 else 0
            watch.close("lost-peer" if watch.lost else "done", linger_s=linger)


def _train(cfg: RunConfig, rank: int, world_size: int, preempt, groups, comm, where: dict) -> int:
    """The run on started process groups; ``where["at"]`` says which step it is in."""
    from rhymerl.launch.preemption import requeue_current_job, requeued_by_slurm
    from rhymerl.launch.time_limit import watch_from_env
    from rhymerl.outputs.checkpoint import CheckpointManager, capture_rng_state, check_compatible, restore_rng_state
    from rhymerl.outputs.disk_space import checkpoint_bytes_estimate
    from rhymerl.outputs.tracking import Tracker
    from rhymerl.trainer import Trainer

    run_dir = Path(cfg.run.output_dir)
    # Collective: a bad checkpoint.resume raises on every rank; files are verified once, in parallel.
    ckpt = CheckpointManager(cfg.checkpoint, run_dir, rank, world_size, barrier=comm.barrier,
                             broadcast_object=comm.broadcast_object, all_gather_object=comm.all_gather_object)
    resume = ckpt.find_resume()
    loaded = ckpt.load(resume, verify=False) if resume else None
    if loaded is not None and loaded.config is not None:
        check_compatible(loaded.config, to_dict(cfg))

    trainer = Trainer(cfg, comm, groups, backend_checkpoint=loaded.backend_dir if loaded is not None else None)
    run_id = None
    if loaded is not None:
        trainer.load_state_blobs({**loaded.state["trainer"], "history": loaded.state["history"]})
        if loaded.rank_state is not None:
            restore_rng_state(loaded.rank_state["rng"])
            trainer.engine.load_drafter_state(loaded.rank_state.get("drafter"))
        run_id = loaded.state.get("wandb_run_id")
        if rank == 0:
            log.warning("resumed from %s at step %d", loaded.path, trainer.step)

    total = cfg.run.max_steps or cfg.run.epochs * trainer.sampler.steps_per_epoch
    tracker = Tracker(cfg.tracking, run_dir, cfg.run.name, to_dict(cfg), rank, resume_run_id=run_id, max_steps=total)
    metrics_file = StepLog(run_dir / "metrics.jsonl", trainer.step, enabled=rank == 0)
    traces_file = StepLog(run_dir / "traces.jsonl", trainer.step, enabled=rank == 0 and cfg.run.save_traces)
    # W&B gets what an earlier segment's W&B lost, and not the steps it holds that this one repeats.
    tracker.catch_up(metrics_file.rows())

    def save() -> None:
        blobs = trainer.state_blobs()
        history = blobs.pop("history")
        ckpt.save(trainer.step, {"trainer": blobs, "history": history, "wandb_run_id": tracker.run_id},
                  rank_state={"rng": capture_rng_state(), "drafter": trainer.engine.drafter_state()},
                  backend_save=trainer.backend.save_checkpoint, config=to_dict(cfg),
                  expected_bytes=checkpoint_bytes_estimate(trainer.model_path, cfg.model.dtype) + len(history))

    # Only rank 0 asks Slurm; the decision reaches every rank through the step-end all-reduce.
    time_watch = watch_from_env(cfg.slurm.signal_lead_s) if rank == 0 else None
    longest_step_s = 0.0
    exit_code = 0
    try:
        # Else run.epochs bounds the data: DAPO's refills draw extra batches, so steps would overrun.
        while (trainer.step < cfg.run.max_steps) if cfg.run.max_steps else (trainer.sampler.next_epoch < cfg.run.epochs):
            where["at"] = f"during step {trainer.step}"
            t_step = time.monotonic()
            out = trainer.train_step()
            tracker.log(out.step, out.metrics)
            tracker.log_lengths(out.step, [len(s.token_ids) for s in out.samples])
            tracker.log_samples(out.step, [{"reward": s.reward, "response": s.text} for s in out.samples[:8]])
            tracker.flush()
            metrics_file.append(out.step, [_plain_metrics(out.metrics)])
            traces_file.append(out.step, _trace_rows(trainer, out))
            last = trainer.step == cfg.run.max_steps if cfg.run.max_steps else trainer.sampler.next_epoch >= cfg.run.epochs
            longest_step_s = max(longest_step_s, time.monotonic() - t_step)
            time_up = None if time_watch is None or last else time_watch.should_stop(longest_step_s)
            if time_up:
                log.warning("%s: will checkpoint and requeue now", time_up)
            # A cancel (TERM without USR1) is never turned into a requeue by the time limit.
            cancelled = preempt.requested and not preempt.requeue_requested
            stop = comm.any_true(preempt.requested or bool(time_up))
            requeue = stop and comm.any_true(preempt.requeue_requested or (bool(time_up) and not cancelled))
            if stop or ckpt.should_save(trainer.step) or last:
                save()
                # A step's cost, for the time-limit watch, includes its periodic checkpoint.
                longest_step_s = max(longest_step_s, time.monotonic() - t_step)
            if stop and not last:
                # W&B's service may have died with the job's SIGTERM: log what it lost first.
                tracker.repair(metrics_file.rows())
                if not requeue:
                    if rank == 0:
                        # A SIGTERM is a cancel, a time limit, or Slurm requeueing the job: ask which.
                        log.warning("stopped after step %d on %s: checkpoint saved, %s", trainer.step,
                                    preempt.signal_name, REQUEUE_WORDS[requeued_by_slurm()])
                    return 128 + signal.SIGTERM
                if rank == 0:
                    requeued = requeue_current_job()
                    log.warning("preempted after step %d: checkpoint saved%s", trainer.step,
                                ", job requeued" if requeued else "")
                return 0
    except BaseException:
        exit_code = 1
        raise
    finally:
        tracker.repair(metrics_file.rows(), exit_code)
        trainer.close()
    return 0


def run_from_config(argv: list[str], preempt=None) -> int:
    """``preempt``: the caller's PreemptionHandler (rank_main installs one before any import)."""
    from rhymerl.launch.preemption import PreemptionHandler

    # First: a preemption notice that arrives while the trainer starts must not kill it.
    preempt = preempt if preempt is not None else PreemptionHandler()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        print(f"rhymerl: config error: {e}", file=sys.stderr)
        return 2
    from rhymerl.launch import user_errors

    rank, world_size, _ = launcher_env()
    lock = None
    if rank == 0:
        from rhymerl.outputs.run_lock import RunFolderBusy, RunFolderLock

        # Before anything is written: another run's folder gets nothing from us, not even an error log.
        try:
            lock = RunFolderLock(owned_folders(cfg)).acquire()
        except RunFolderBusy as e:
            return user_errors.report(e, None, rank)
    try:
        return _run_owned(cfg, rank, world_size, preempt)
    finally:
        if lock is not None:
            lock.release()


def owned_folders(cfg: RunConfig) -> list[Path]:
    """The folders a run writes into and must own: its run folder, and its checkpoint folder if elsewhere."""
    run_dir = Path(cfg.run.output_dir).resolve()
    folders = [run_dir]
    if cfg.checkpoint.dir:
        ckpt = Path(cfg.checkpoint.dir).resolve()
        if not ckpt.is_relative_to(run_dir):
            folders.append(ckpt)
    return folders


def _run_owned(cfg: RunConfig, rank: int, world_size: int, preempt) -> int:
    from rhymerl.launch import user_errors
    from rhymerl.launch.versions import VersionMismatch, check_runtime_versions, check_torch_build

    try:
        check_runtime_versions()
        check_torch_build(wants_cuda=cfg.parallel.dist_backend == "nccl" or cfg.slurm.gpus_per_node > 0)
    except VersionMismatch as e:
        print(f"rhymerl: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        from rhymerl.launch.preflight import check_model

        check_model(cfg, world_size)  # The model's shape against the config (layout, lengths) before anything starts.
        rc = run(cfg, rank, world_size, preempt)
        # Teardown takes seconds; a SIGUSR1 arriving then would kill a finished run and mark the job FAILED.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except Exception as e:
        code = user_errors.report(e, Path(cfg.run.output_dir), rank)
        if code is None:
            raise
        return code
    if rank == 0:
        log.info("finished in %.1f s", time.time() - t0)
    return rc
