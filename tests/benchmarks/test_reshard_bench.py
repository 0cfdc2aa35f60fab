"""`python -m benchmarks reshard --json` keeps its output contract (tiny model only, for speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.integration]


def test_bench_reshard_json_contract():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "reshard", "--json", "--skip-large",
                           "--repeats", "1", "--buckets-mb", "0.01,1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    rows = out["results"]
    assert [r["bucket_mb"] for r in rows] == [0.01, 1.0]
    for r in rows:
        assert {"model", "bucket_mb", "gb_per_s", "peak_extra_mb", "ratio_to_state_dict_copy"} <= set(r)
        assert r["gb_per_s"] > 0 and r["ratio_to_state_dict_copy"] > 0
        assert r["exact"] and r["peak_extra_within_bucket"]
    # 10 kB buckets: about one tensor each (most exceed 10 kB alone); 1 MB buckets: two.
    assert rows[0]["buckets"] > 10 and rows[1]["buckets"] == 2
    assert "GB/s" in done.stderr
