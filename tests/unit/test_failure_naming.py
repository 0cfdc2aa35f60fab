"""The pure parts of naming a failure: a full disk in an exception chain, a dead rank among the
beats, a requeue in `scontrol show job`, a worker's end."""

from __future__ import annotations

import errno

import pytest

from rhymerl.distributed.peer_watch import Peer, looks_like_peer_failure, lost_message, silent_ranks
from rhymerl.launch.preemption import restarts_of
from rhymerl.outputs.disk_space import full_message, human, ran_out, says_full
from rhymerl.rewards.pool import describe_exit

pytestmark = pytest.mark.cpu


def _raised(exc: BaseException, cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as c:
            raise exc from c
    except BaseException as e:
        return e


def test_a_full_disk_is_found_wherever_the_writer_put_it():
    from torch.distributed.checkpoint.api import CheckpointException

    enospc = OSError(errno.ENOSPC, "No space left on device")
    # torch's checkpoint writer keeps each rank's failure in a dict, not in the chain.
    dcp = CheckpointException("write", {0: (enospc, None)})
    assert says_full(dcp) and says_full(_raised(RuntimeError("save failed"), enospc))
    assert says_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    zip_stream = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert not says_full(zip_stream) and not says_full(CheckpointException("write", {0: (zip_stream, None)}))
    # No errno: the space the folder holds plus what is left falls short of the checkpoint.
    assert ran_out(zip_stream, written=3_000_000, free=1_000, need=5_000_000)
    assert not ran_out(zip_stream, written=3_000_000, free=9_000_000, need=5_000_000)
    assert ran_out(zip_stream, written=0, free=10, need=None)
    assert full_message("/ckpt", 2_700_000, 4_900_000) == \
        "No space left on device in /ckpt (2.7 MB free, the checkpoint needs about 4.9 MB)"
    assert human(999) == "999 B" and human(1_234_567_890) == "1.2 GB"


def test_the_ranks_whose_beat_stopped_are_the_dead():
    before = {1: "7", 2: "9", 3: "4"}
    assert silent_ranks(before, {1: "8", 2: "9", 3: "exit:lost-peer"}, set()) == [2]
    assert silent_ranks(before, {1: "8", 2: "10", 3: "5"}, {3}) == [3]
    assert silent_ranks(before, {1: "8", 2: "10", 3: "5"}, set()) == []


def test_lost_rank_line():
    line = lost_message([Peer(0, "node7", 41)], True, "during step 12")
    assert line.startswith("rank 0 on host node7 (pid 41, which held the rendezvous store) died during step 12; ")
    two = lost_message([Peer(1, "a", 5), Peer(3, "b", 6)], False, "during step 2")
    assert two.startswith("rank 1 on host a (pid 5) and rank 3 on host b (pid 6) died during step 2; ")
    assert "\n" not in line


def test_peer_failures_are_told_from_other_errors():
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:56000")
    assert looks_like_peer_failure(gloo) and looks_like_peer_failure(_raised(ValueError("wrapped"), gloo))
    assert not looks_like_peer_failure(RuntimeError("CUDA out of memory"))
    assert not looks_like_peer_failure(KeyError("x"))


def test_requeue_is_read_from_the_restart_count():
    show = "JobId=7 JobName=x UserId=root(0) JobState=COMPLETING Reason=None Requeue=1 Restarts=2 BatchFlag=1"
    assert restarts_of(show) == 2 and restarts_of("JobId=7 JobState=RUNNING") is None


def test_worker_ends_are_named():
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exit code 3"
    assert describe_exit(None) == "exit status unknown"
