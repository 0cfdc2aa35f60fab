"""Live phase progress: rate-limited lines with counts and rates."""

import io

import pytest

from rhymerl.outputs.progress import PhaseProgress

pytestmark = pytest.mark.cpu


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lines_are_rate_limited_and_carry_counts_and_rates():
    out, clock = io.StringIO(), Clock()
    p = PhaseProgress(stream=out, interval_s=10.0, clock=clock)
    p.start("step 3 rollout", total=32, unit="requests")
    clock.t += 4
    p.update(5, tokens=400)
    assert out.getvalue() == ""  # within the interval: nothing written
    clock.t += 6
    p.update(12, tokens=2000)
    assert out.getvalue() == "step 3 rollout: 12/32 requests, 2,000 tokens (200/s), 10 s\n"
    clock.t += 1
    p.update(13, tokens=2100)
    assert out.getvalue().count("\n") == 1
    p.finish()


def test_disabled_progress_writes_nothing():
    out, clock = io.StringIO(), Clock()
    p = PhaseProgress(stream=out, interval_s=0.0, clock=clock, enabled=False)
    p.start("train", total=4, unit="micro-batches")
    clock.t += 5
    p.update(2)
    assert out.getvalue() == ""
    assert p.line() == "train: 2/4 micro-batches, 5 s"


def test_context_names_the_step_and_finish_ends_a_terminal_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, clock = Tty(), Clock()
    p = PhaseProgress(stream=out, interval_s=1.0, clock=clock)
    p.context = "step 7"
    p.start("training", total=4, unit="micro-batches")
    clock.t += 2
    p.update(3, tokens=3000)
    p.finish()
    assert out.getvalue() == "\r\x1b[2Kstep 7 training: 3/4 micro-batches, 3,000 tokens (1,500/s), 2 s\n"
