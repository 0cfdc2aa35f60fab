"""rhymerl.launch.netif: the interface a rank's gloo/NCCL sockets use on a multi-node job."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rhymerl.launch import netif

pytestmark = pytest.mark.cpu
REPO = Path(__file__).resolve().parents[2]


def _never(addr):
    raise AssertionError(f"no route lookup expected (asked for {addr})")


def test_route_to_loopback_is_the_loopback_interface():
    holders = [name for name, addrs in psutil.net_if_addrs().items()
               if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)]
    assert holders, "this host has no interface holding 127.0.0.1"
    assert netif.route_interface("127.0.0.1") in holders


@pytest.mark.parametrize("addr", ["fe80::1",  # link-local without an interface: no route
                                  "255.255.255.255"])  # broadcast: connect() is refused
def test_no_route_gives_none(addr):
    assert netif.route_interface(addr) is None


def test_multi_node_job_gets_both_variables():
    env = {"MASTER_ADDR": "10.0.0.1"}
    assert netif.socket_env_hints(env, 4, route=lambda a: ("10.0.0.2", "ib0")) == {
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}


def test_a_users_setting_is_kept():
    env = {"MASTER_ADDR": "10.0.0.1", "NCCL_SOCKET_IFNAME": "=eth3"}
    assert netif.socket_env_hints(env, 4, route=lambda a: ("10.0.0.2", "ib0")) == {"GLOO_SOCKET_IFNAME": "ib0"}
    env["GLOO_SOCKET_IFNAME"] = "eth3"
    assert netif.socket_env_hints(env, 4, route=_never) == {}


def test_one_node_needs_nothing():
    assert netif.socket_env_hints({"MASTER_ADDR": "10.0.0.1"}, 1, route=_never) == {}


def test_loopback_or_missing_route_sets_nothing():
    env = {"MASTER_ADDR": "node0"}
    # A multi-node MASTER_ADDR that resolves to a loopback address here must not pin the sockets to it.
    assert netif.socket_env_hints(env, 2, route=lambda a: ("127.0.1.1", "lo")) == {}
    assert netif.socket_env_hints(env, 2, route=lambda a: None) == {}
    assert netif.socket_env_hints({}, 2, route=_never) == {}
    assert netif.socket_env_hints({"MASTER_ADDR": "127.0.0.1"}, 2) == {}  # the real lookup


@pytest.mark.parametrize("env, nodes", [({"SLURM_NNODES": "4", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 4),
                                        ({"SLURM_JOB_NUM_NODES": "2"}, 2),
                                        ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),
                                        ({}, 1)])
def test_job_nodes(env, nodes):
    assert netif.job_nodes(env) == nodes


def test_describe_says_where_each_value_came_from():
    line = netif.describe({"MASTER_ADDR": "10.0.0.1", "NCCL_SOCKET_IFNAME": "eth3"}, {"GLOO_SOCKET_IFNAME": "ib0"})
    assert line == ("GLOO_SOCKET_IFNAME=ib0 (routes to MASTER_ADDR=10.0.0.1); "
                    "NCCL_SOCKET_IFNAME=eth3 (from the environment)")


def test_rank_main_logs_its_choice_before_starting(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(SLURM_NNODES="2", SLURM_PROCID="1", SLURM_NTASKS="2", MASTER_ADDR="127.0.0.1",
               GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-m", "rhymerl.launch.rank_main", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert res.returncode != 0  # the config does not exist
    assert ("[rhymerl] rank 1: GLOO_SOCKET_IFNAME=lo (from the environment); "
            "NCCL_SOCKET_IFNAME unset (no non-loopback route to MASTER_ADDR=127.0.0.1)") in res.stderr
