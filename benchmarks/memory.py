"""Peak resident memory of colocated RL steps, per model parameter and by component.

`python -m benchmarks memory [--config configs/tiny-cpu.yaml] [--steps 2] [--json] [key=value ...]`

Builds the run's trainer (training backend + rollout engine in this process, as every rank
holds them), runs ``--steps`` RL steps (default 2) and reports, in bytes per model parameter:

- the process's peak resident set over the run (``VmHWM``), each step's peak and the peak of
  each phase of the last step (sampled every 5 ms). The first step understates what a run
  needs: the optimizer creates Adam's moments (8 bytes per parameter) only at its end, after
  the activations are gone; from the second step on they are resident throughout;
- the tensors each component holds, counted exactly: training weights, gradient buffers,
  optimizer state, engine weights, engine KV cache (on CPU the engine frees the KV cache while
  training, and at sleep level 2 its weights' memory too, so they are not part of a
  training-phase peak);
- activations/logits: the last step's training phase peak above the resident set at its start
  (what the allocator holds for them, which is more than the live tensors: glibc keeps freed
  blocks of up to 32 MB in its heap for reuse);
- other: the peak minus all of the above (Python, torch/vLLM runtime, tokenizer, data,
  allocator slack, oneDNN's packed copies of the engine weights).

Reward workers are separate processes and are not counted (``reward.workers=0`` scores in-process).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path


def _rss() -> int:
    from rhymerl.distributed.devices import resident_bytes

    return resident_bytes()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PhasePeaks:
    """Samples the resident set in a thread; the peak of each named phase."""

    def __init__(self, interval_s: float = 0.005):
        self.phase = "start"
        self.peaks: dict[str, int] = {}
        self.at_start: dict[str, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)
        self._t.start()

    def _loop(self, dt: float) -> None:
        while not self._stop.is_set():
            self._note()
            time.sleep(dt)

    def _note(self) -> None:
        r = _rss()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), r)

    def reset(self) -> None:
        self.peaks, self.at_start = {}, {}

    def enter(self, phase: str) -> None:
        self._note()
        self.phase = phase
        self.at_start[phase] = _rss()
        self._note()

    def stop(self) -> None:
        self._note()
        self._stop.set()
        self._t.join()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _training_bytes(backend) -> dict[str, int]:
    import torch

    weights = _nbytes(p for p in backend.module.parameters())
    grads = 0
    for buf in getattr(backend.model, "buffers", []) or []:
        g = getattr(buf, "grad_data", None)
        if isinstance(g, torch.Tensor):
            grads += g.numel() * g.element_size()
    if not grads:
        grads = _nbytes(p.grad for p in backend.module.parameters() if p.grad is not None)
    opt = backend.optimizer
    inner = [getattr(o, "optimizer", o) for o in getattr(opt, "chained_optimizers", [opt])] if opt is not None else []
    state = 0
    for o in inner:
        for s in getattr(o, "state", {}).values():
            state += _nbytes(v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"training_weights": weights, "training_grads": grads, "optimizer_state": state}


def _engine_tensors(worker):
    """(weight bytes, KV cache bytes) of the engine's model runner."""
    from rhymerl.rollout.engine import _kv_cache_tensors, _runner_of

    runner = _runner_of(worker)
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    return weights, sum(t.untyped_storage().nbytes() for t in _kv_cache_tensors(runner))


# Qwen2.5-0.5B's published config.json (the smallest of the paper's model family).
QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)


def write_qwen25_05b_shape(folder: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model with random weights (seed 0) and the offline test tokenizer,
    padded with unused special tokens to the model's vocabulary (the random policy samples ids
    anywhere in it, and the history store refuses ids outside the tokenizer's)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from rhymerl.outputs.atomic import atomic_folder
    from rhymerl.models.tokenizer import save_tokenizer

    if (folder / "config.json").is_file():
        return folder
    with atomic_folder(folder) as tmp:
        n = save_tokenizer(tmp)
        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        tok.add_tokens([AddedToken(f"<|unused{i}|>", special=True) for i in range(QWEN25_05B["vocab_size"] - n)])
        tok.save(str(tmp / "tokenizer.json"))
        tok = transformers.AutoTokenizer.from_pretrained(str(tmp))
        config = transformers.Qwen2Config(**QWEN25_05B, use_sliding_window=False, eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id, bos_token_id=None, torch_dtype="float32")
        torch.manual_seed(0)
        model = transformers.Qwen2ForCausalLM(config)
        model.save_pretrained(str(tmp), safe_serialization=True)
        model.generation_config.save_pretrained(str(tmp))
        del model
    return folder


def measure(cfg, steps: int = 2) -> dict:
    from rhymerl.distributed.collectives import WorldComm
    from rhymerl.distributed.memory_plan import model_params
    from rhymerl.resharding.layout import ModelLayout
    from rhymerl.trainer import Trainer
    from rhymerl.distributed.process_groups import init_process_groups

    peaks = PhasePeaks()
    groups = init_process_groups(cfg.parallel, 1, 0)
    peaks.enter("build")
    trainer = Trainer(cfg, WorldComm(), groups)
    try:
        layout = ModelLayout.from_hf_config(json.loads((Path(trainer.model_path) / "config.json").read_text()))
        n = model_params(layout)
        built = _rss()
        # Counted now: on CPU the engine frees its KV cache while training (colocation sleep).
        ew, kv = trainer.engine.llm.collective_rpc(_engine_tensors)[0]
        # Phase peaks of the step: the trainer's own phases, marked from its methods.
        for name in ("_rollout", "_train", "_reshard"):
            real = getattr(trainer, name)

            def marked(*a, _real=real, _name=name.strip("_"), **k):
                peaks.enter(_name)
                try:
                    return _real(*a, **k)
                finally:
                    peaks.enter("between")
            setattr(trainer, name, marked)
        step_peaks, tokens = [], []
        for _ in range(steps):
            # Each step's peaks are its own (the first step's would otherwise include the build).
            peaks.reset()
            peaks.enter("between")
            out = trainer.train_step()
            peaks.enter("between")
            step_peaks.append(max(peaks.peaks.values()))
            tokens.append(sum(len(s.token_ids) for s in out.samples))
        peaks.stop()
        comp = _training_bytes(trainer.backend)
        comp.update({"engine_weights": ew, "engine_kv_cache": kv})
        train_peak = peaks.peaks.get("train", 0)
        comp["activations_logits"] = max(train_peak - peaks.at_start.get("train", train_peak), 0)
        peak = step_peaks[-1]
        peak_phase = max(peaks.peaks, key=peaks.peaks.get)
        freed = out.metrics.get("colocation/engine_sleep_freed_gb", 0.0) * 1e9
        # What the engine released for training (KV cache; at level 2 its weights' memory too)
        # is not part of a training-phase peak.
        released = min(freed, ew + kv) if peak_phase == "train" else 0
        comp["other"] = peak - (sum(comp.values()) - released)
        per = lambda b: round(b / n, 2)  # noqa: E731
        hwm = _hwm()
        return {
            "config": cfg.run.name, "attention": cfg.parallel.attention,
            "recompute_activations": cfg.parallel.recompute_activations,
            "recompute_norms": cfg.parallel.recompute_norms, "micro_batch_tokens": cfg.algo.micro_batch_tokens,
            "model_params": n, "steps": steps, "peak_rss_bytes": hwm, "peak_bytes_per_param": per(hwm),
            "step_peak_bytes_per_param": [per(b) for b in step_peaks],
            "bytes_per_param": {k: per(v) for k, v in comp.items()},
            "phase_peak_bytes_per_param": {k: per(v) for k, v in peaks.peaks.items()}, "peak_phase": peak_phase,
            "engine_freed_for_training_bytes_per_param": per(freed),
            "rss_after_build_bytes_per_param": per(built),
            "step_s": out.metrics.get("time/step_s"), "train_s": out.metrics.get("time/train_s"),
            "logprob_max_abs": out.metrics.get("train/logprob_max_abs"), "rollout_tokens": tokens,
        }
    finally:
        trainer.close()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny-cpu.yaml")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--out", default="runs/bench-memory")
    ap.add_argument("--steps", type=int, default=2,
                    help="RL steps to run; the components are the last step's (default 2: Adam's moments exist "
                         "only from the end of the first)")
    ap.add_argument("--qwen25-05b-shape", action="store_true",
                    help="measure a Qwen2.5-0.5B-shaped model with random weights (written once under --out)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps: {args.steps} must be >= 1")
    from benchmarks.rollout import quiet_stdout
    from rhymerl.config import load_config

    # vLLM's, megatron's and DeepSpeed's logs (the last on import, while the model is written)
    # go to stderr; stdout carries the result.
    with quiet_stdout():
        extra = []
        if args.qwen25_05b_shape:
            model = write_qwen25_05b_shape(Path(args.out) / "qwen2.5-0.5b-shape")
            # Random weights: HistoSpec has no history worth drafting and the tokenizer does not
            # cover the vocabulary; the engine generates plainly.
            extra = [f"model.path={model}", "rollout.speculative=none"]
        cfg = load_config(args.config, [*extra, *args.overrides, f"run.output_dir={args.out}",
                                        f"run.max_steps={args.steps}", "tracking.wandb=disabled",
                                        "checkpoint.every_steps=0"])
        res = measure(cfg, args.steps)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"peak resident memory {res['peak_rss_bytes'] / 1e9:.2f} GB for {res['model_params'] / 1e6:.1f}M "
              f"parameters: {res['peak_bytes_per_param']} bytes/param (per step: {res['step_peak_bytes_per_param']})")
        for k, v in res["bytes_per_param"].items():
            print(f"  {k:20s} {v:8.2f} B/param")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
