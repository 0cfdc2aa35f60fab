"""rhymerl.launch.slurm: the rendered sbatch script for one node / many nodes, and config checks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rhymerl.launch import slurm as sl
from rhymerl.config import ConfigError, ParallelConfig, SlurmConfig

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]
PLACEHOLDER = Path("/path/to/rhymerl")

# The committed examples in slurm/ are these renders; RHYMERL_UPDATE_SLURM_EXAMPLES=1 rewrites them.
# name -> (slurm section, parallel section, overrides, the config file the script runs).
GPU_CONFIG = "configs/qwen2.5-32b-grpo-math-4x8xh100.yaml"
EXAMPLES = {
    "single-node-cpu.sbatch": (SlurmConfig(tasks_per_node=2, cpus_per_task=1, time="00:30:00", signal_lead_s=60),
                               ParallelConfig(), ["run.max_steps=20"], "configs/tiny-cpu.yaml"),
    # The GPU example is the shipped multi-node config's own render (its slurm and parallel sections).
    "multi-node-gpu.sbatch": (None, None, [], GPU_CONFIG),
}


def _example(name: str):
    slurm, parallel, overrides, config = EXAMPLES[name]
    job_name = "rhymerl"
    if slurm is None:
        from rhymerl.config import load_config

        cfg = load_config(REPO / config)
        slurm, parallel, job_name = cfg.slurm, cfg.parallel, cfg.run.name
    return slurm, parallel, overrides, config, job_name


def _render(slurm: SlurmConfig, parallel: ParallelConfig = ParallelConfig(), overrides=(), **kw) -> str:
    kw.setdefault("workdir", PLACEHOLDER)
    kw.setdefault("python", str(PLACEHOLDER / ".venv/bin/python"))
    return sl.render_script(slurm, parallel, job_name=kw.pop("job_name", "rhymerl"),
                            config_path=Path(kw.pop("config_path", "configs/tiny-cpu.yaml")),
                            overrides=list(overrides), **kw)


def _directives(text: str) -> list[str]:
    return [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_examples_match_renderer(name):
    slurm, parallel, overrides, config, job_name = _example(name)
    text = _render(slurm, parallel, overrides, config_path=config, job_name=job_name)
    path = REPO / "slurm" / name
    if os.environ.get("RHYMERL_UPDATE_SLURM_EXAMPLES") == "1":
        path.write_text(text)
    assert path.read_text() == text, f"{path} is stale; rerun with RHYMERL_UPDATE_SLURM_EXAMPLES=1"
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0


def test_examples_run_a_shipped_config_on_the_hardware_they_request():
    from rhymerl.config import load_config

    for name in EXAMPLES:
        text = (REPO / "slurm" / name).read_text()
        config = text.split("-m rhymerl.launch.rank_main ", 1)[1].split()[0].removeprefix(f"{PLACEHOLDER}/")
        cfg = load_config(REPO / config)
        gpus = next((int(d.split("=")[1]) for d in _directives(text) if d.startswith("--gpus-per-node=")), 0)
        # A GPU script must not run the CPU config (and the reverse): the devices would sit idle.
        assert (gpus > 0) == (cfg.slurm.gpus_per_node > 0 or cfg.parallel.dist_backend == "nccl"), (name, config)


def test_single_node_cpu_script():
    text = _render(SlurmConfig(tasks_per_node=2, signal_lead_s=45, log_dir="logs"),
                   overrides=["algo.lr=1e-6", "data.system_prompt=be brief; think"])
    d = _directives(text)
    assert "--nodes=1" in d and "--ntasks-per-node=2" in d and "--signal=USR1@45" in d
    assert "--requeue" in d and "--open-mode=append" in d and f"--chdir={PLACEHOLDER}" in d
    assert f"--output={PLACEHOLDER}/logs/%x-%j.out" in d
    assert not any(x.startswith("--gpus") for x in d)
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in text
    assert "NCCL_DEBUG" not in text
    assert (f'"$PYTHON" -m rhymerl.launch.rank_main {PLACEHOLDER}/configs/tiny-cpu.yaml algo.lr=1e-6 '
            "'data.system_prompt=be brief; think' &") in text
    assert 'JOB_LOG_DIR="$LOG_ROOT/${SLURM_JOB_NAME}-${SLURM_JOB_ID}"' in text


def test_multi_node_gpu_script_runs_one_task_per_gpu():
    text = _render(SlurmConfig(nodes=4, gpus_per_node=8, partition="p", account="a", requeue=False),
                   ParallelConfig(tensor_parallel=4, pipeline_parallel=2))
    d = _directives(text)
    assert {"--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=p", "--account=a",
            "--no-requeue"} <= set(d)
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in text and "NCCL_DEBUG" in text
    assert "32 ranks (4 node(s) x 8 GPU task(s))" in text


@pytest.mark.parametrize("slurm, parallel, match", [
    (SlurmConfig(gpus_per_node=8, tasks_per_node=4), ParallelConfig(), "one task per GPU"),
    (SlurmConfig(tasks_per_node=3), ParallelConfig(tensor_parallel=2), "TP\\*PP=2 does not divide the 3 ranks"),
    (SlurmConfig(nodes=2, tasks_per_node=2), ParallelConfig(world_size=8), "parallel.world_size: 8"),
    (SlurmConfig(time="00:01:00", signal_lead_s=120), ParallelConfig(), "not shorter than slurm.time"),
    (SlurmConfig(time="1:2:3:4"), ParallelConfig(), "not a Slurm time"),
    (SlurmConfig(extra_sbatch=["exclusive"]), ParallelConfig(), "must be an sbatch option"),
])
def test_bad_layouts_are_refused_with_the_key(slurm, parallel, match):
    with pytest.raises(ConfigError, match=match):
        _render(slurm, parallel)


def test_extra_sbatch_and_no_signal():
    d = _directives(_render(SlurmConfig(signal_lead_s=0, extra_sbatch=["#SBATCH --exclusive", "--qos=high"])))
    assert "--exclusive" in d and "--qos=high" in d and not any(x.startswith("--signal") for x in d)


@pytest.mark.parametrize("text, secs", [("30", 1800), ("5:30", 330), ("01:00:00", 3600), ("2-0", 172800),
                                        ("1-02:03", 93780), ("1-00:00:10", 86410), ("UNLIMITED", None)])
def test_parse_slurm_time(text, secs):
    assert sl.parse_slurm_time(text) == secs


def test_setup_lines_and_custom_entry():
    text = _render(SlurmConfig(), setup_lines=["module load cuda/12.4"], entry=["tools/x.py"])
    assert "module load cuda/12.4" in text
    assert f'"$PYTHON" tools/x.py {PLACEHOLDER}/configs/tiny-cpu.yaml &' in text


def test_cli_render_and_dry_run_submit(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "cli"}, "slurm": {"tasks_per_node": 2,
                                                                      "log_dir": str(tmp_path / "logs")}}))
    monkeypatch.chdir(tmp_path)
    assert sl.main(["render", str(cfg), "algo.lr=2e-6"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH --job-name=cli" in out and "algo.lr=2e-6" in out
    assert sl.main(["submit", str(cfg), "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "#SBATCH --ntasks-per-node=2" in captured.out and "[dry-run]" in captured.err
    assert not (tmp_path / "logs").exists(), "a dry run must not create anything"
    assert sl.main(["render", str(cfg), "slurm.nodes=0"]) == 2
    assert "slurm.nodes" in capsys.readouterr().err


def test_cli_is_wired_through_rhymerl(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("run: {name: wired}\n")
    res = subprocess.run([os.sys.executable, "-m", "rhymerl", "slurm", "render", str(cfg)], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --job-name=wired" in res.stdout


def test_docs_name_only_config_files_that_exist():
    import re

    for doc in ("README.md", "slurm/README.md", *(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))):
        for name in re.findall(r"configs/[\w.\-]+\.yaml", (REPO / doc).read_text()):
            if name != "configs/my-run.yaml":  # the placeholder for a user's own config
                assert (REPO / name).is_file(), f"{doc} names {name}, which does not exist"


SETUP = ["module load cuda/12.4", "export WANDB_API_KEY=0123abcd", "export HF_TOKEN='hf_x y'", "wandb login 9f9f9f"]


def test_setup_secrets_are_redacted_in_what_is_saved_or_logged():
    from rhymerl.config import load_config, to_dict, to_yaml

    cfg = load_config(None, [f"slurm.setup={SETUP}"])
    assert cfg.slurm.setup == SETUP  # the script that runs needs them
    # to_dict is what checkpoints, the W&B config and --print-config hold.
    saved = to_dict(cfg)["slurm"]["setup"]
    assert saved == ["module load cuda/12.4", "export WANDB_API_KEY=<redacted>", "export HF_TOKEN=<redacted>",
                     "wandb login <redacted>"]
    for secret in ("0123abcd", "hf_x", "9f9f9f"):
        assert secret not in to_yaml(cfg)


def test_submitted_script_keeps_secrets_and_saved_copy_does_not(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/args\ncat > {tmp_path}/stdin\necho 4242\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run": {"name": "sec"}, "slurm": {"log_dir": str(tmp_path / "logs"), "setup": SETUP}}))
    monkeypatch.chdir(tmp_path)
    assert sl.main(["submit", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == "4242"
    submitted = (tmp_path / "stdin").read_text()
    assert "export WANDB_API_KEY=0123abcd" in submitted and "wandb login 9f9f9f" in submitted
    (saved,) = (tmp_path / "logs" / "scripts").iterdir()
    text = saved.read_text()
    assert "export WANDB_API_KEY=<redacted>" in text and "0123abcd" not in text and "9f9f9f" not in text
    assert text.replace("<redacted>", "") == submitted.replace("0123abcd", "").replace("'hf_x y'", "").replace("9f9f9f", "")


def test_rendered_port_choice_is_the_job_ids_own_block(tmp_path):
    # Run the script's port lines: jobs with adjacent ids (started together on one node)
    # probe disjoint blocks, and a job's first free port lies in its own block.
    text = _render(SlurmConfig(tasks_per_node=2, cpus_per_task=1))
    lines = text.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("BASE_PORT="))
    end = next(i for i, x in enumerate(lines) if x.startswith("export MASTER_ADDR MASTER_PORT"))
    script = tmp_path / "port.sh"
    script.write_text("\n".join(["set -e", 'PYTHON="$1"', "SLURM_JOB_ID=$2", *lines[start:end], 'echo "$BASE_PORT $MASTER_PORT"']))
    blocks = []
    for job in (43, 44, 265 + 43, 99999):
        out = subprocess.run(["bash", str(script), sys.executable, str(job)], capture_output=True, text=True, check=True)
        base, port = map(int, out.stdout.split())
        block = sl.master_port_block(job)
        assert base == block.start and port in block and block.stop <= 32768  # below the ephemeral range
        blocks.append(block)
    assert not set(blocks[0]) & set(blocks[1])


def _srun_line(text: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith("srun ")]
    return line


def test_gpu_srun_line_gives_every_task_all_its_nodes_gpus():
    # Each task uses cuda:LOCAL_RANK, so every task must see the node's GPUs in the same order:
    # the binding is stated on the srun line, where a site default cannot change it.
    text = _render(SlurmConfig(nodes=4, gpus_per_node=8), ParallelConfig(tensor_parallel=4))
    srun = _srun_line(text).split()
    assert {"--gpu-bind=none", "--ntasks-per-node=8", "--gpus-per-node=8"} <= set(srun)
    assert "LOCAL_RANK = SLURM_LOCALID" in text
    cpu = _srun_line(_render(SlurmConfig(tasks_per_node=2)))
    assert "--gpu" not in cpu and "--ntasks-per-node" not in cpu


def test_srun_asks_for_the_tasks_cpus_itself():
    # Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: each task would get one CPU.
    gpu = _srun_line(_render(SlurmConfig(gpus_per_node=8, cpus_per_task=12))).split()
    cpu = _srun_line(_render(SlurmConfig(tasks_per_node=2, cpus_per_task=3))).split()
    assert "--cpus-per-task=12" in gpu and "--cpus-per-task=3" in cpu


def test_multi_node_script_names_the_socket_interface(tmp_path):
    four = dict(nodes=4, gpus_per_node=8)
    found = _render(SlurmConfig(**four), ParallelConfig(tensor_parallel=4))
    # Left empty, each rank (rank_main) finds the interface that routes to MASTER_ADDR.
    assert "routes to MASTER_ADDR" in found and "rhymerl.launch.netif" in found
    assert "export GLOO_SOCKET_IFNAME" not in found and "export NCCL_SOCKET_IFNAME" not in found
    one = _render(SlurmConfig(tasks_per_node=2))  # one node: nothing to choose
    assert "rhymerl.launch.netif" not in one and "export GLOO_SOCKET_IFNAME" not in one
    text = _render(SlurmConfig(socket_ifname="ib0", **four), ParallelConfig(tensor_parallel=4))
    exports = [x for x in text.splitlines() if x.startswith("export ") and "_SOCKET_IFNAME=" in x]
    assert exports == ["export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-ib0}",
                       "export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-ib0}"]
    # A value set at submission (sbatch passes the environment on) wins over the config's.
    script = tmp_path / "ifname.sh"
    script.write_text("\n".join([*exports, 'echo "$GLOO_SOCKET_IFNAME $NCCL_SOCKET_IFNAME"']))
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["ib0", "ib0"]
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True,
                         env={**env, "NCCL_SOCKET_IFNAME": "eth3"}).stdout
    assert out.split() == ["ib0", "eth3"]


def test_socket_ifname_must_be_an_interface_name():
    with pytest.raises(ConfigError, match="slurm.socket_ifname"):
        _render(SlurmConfig(socket_ifname="eth0; rm -rf x"))
