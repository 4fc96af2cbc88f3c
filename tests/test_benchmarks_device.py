"""The device benchmark (``benchmarks/device.sh``) runs end to end in its dry mode and writes the documented JSON.

One subprocess: ``device.sh --dry --backends tensorflow`` (an MLP on 4 rows, one round, on the CPU; about 12 s of
CPU, bounded by a timeout). Every field that ``benchmarks/README.md``'s tables name is checked in the JSON, so the
documentation and the output cannot drift apart.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "benchmarks" / "README.md"


def _documented(table_title: str) -> list[str]:
    """The backticked field names of the README table that follows `table_title`."""
    text = README.read_text()
    start = text.index(table_title)
    fields = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("| field") or line.startswith("|---") or not line.strip():
            if fields and not line.strip():
                break
            continue
        if not line.startswith("|"):
            break
        fields += re.findall(r"`([a-z_]+)`", line.split("|")[1])
    return fields


def test_dry_run_writes_the_documented_json(tmp_path):
    out = tmp_path / "device.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERAS_", "TF_USE_LEGACY", "JAX_", "XLA_"))}
    env["PYTHON"] = sys.executable
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device.sh"), "--dry", "--backends", "tensorflow", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    top, backend, case, pad = (
        _documented("Top level:"),
        _documented("Per backend:"),
        _documented("Per case:"),
        _documented("Per padding case:"),
    )
    assert {"schema", "backends", "wall_s"} <= set(top) and {"ratio", "memory"} <= set(case)
    assert all(field in report for field in top) and report["dry"] is True and report["schema"] == 1
    tf_run = report["backends"]["tensorflow"]
    assert all(field in tf_run for field in backend) and tf_run["device"] == ["cpu"]
    mlp = tf_run["cases"]["mlp"]
    assert all(field in mlp for field in case)
    assert mlp["ratio"] == mlp["dp_step_s"] / mlp["nonprivate_step_s"] > 0
    assert mlp["fallback_variables"] == []
    assert {"nonprivate", "fast", "ratio"} <= set(mlp["memory"])
    assert all(mlp["memory"][m]["peak_mib"] >= 0 for m in ("nonprivate", "fast"))
    lots = tf_run["padding"]["mlp/L=4"]
    assert all(field in lots for field in pad)
    assert lots["rows"] > lots["lot_size"] == 4  # the padded lot is bigger than L
    assert set(lots["median_step_s"]) == {"nonprivate", "equal_rows", "equal_rows_dynamic", "lots", "lots_multiple"}
    assert lots["multiple"] == 2 and lots["rows_multiple_mean"] >= 2  # m = ceil(sqrt(4))
    assert lots["padding_cost"] == lots["median_step_s"]["lots"] / lots["median_step_s"]["equal_rows"]
