"""One JSON of DP/non-private step ratios and peak memory on this machine's accelerator (issue 41 item 8).

Run by ``benchmarks/device.sh`` (which installs what it needs into a virtual environment first); directly::

    python benchmarks/device.py --out benchmarks/results/device.json           # the full run (a GPU)
    python benchmarks/device.py --dry --out /tmp/device.json                   # tiny shapes on CPU, < 30 s

Each Keras backend runs in a child process of its own (Keras 3 picks its backend at import). In a child,
for each case: the step times of ``overhead.py`` (non-private and the fast DP step, same model, weights and
batch, interleaved in rounds; ratio of the medians), then the peak memory of each mode (a fresh process per
mode on a GPU: TensorFlow's ``get_memory_info`` peak, JAX's ``memory_stats`` ``peak_bytes_in_use``; on CPU,
as in ``--dry``, the process's peak RSS in the child itself, reset with ``/proc/self/clear_refs`` before each
fit), then the padding cases of ``padding.py`` (a DP step on a padded Poisson lot against non-private on L
rows). The JSON's fields are documented in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SCHEMA = 1
# (model, batch) timed and measured on each backend; tf-only models are skipped on JAX.
FULL = {
    "cases": [("mlp", 256), ("conv", 64), ("alexnet", 128), ("transformer", 64), ("bert-lora", 64)],
    "padding": [("conv", 64), ("conv", 256), ("mlp", 64), ("mlp", 256)],
    "steps": 10,
    "rounds": 3,
    "warmup_lots": 40,
    "memory_steps": 3,
}
DRY = {"cases": [("mlp", 4)], "padding": [("mlp", 4)], "steps": 2, "rounds": 1, "warmup_lots": 2, "memory_steps": 1}
MODES = ("nonprivate", "fast")


def _gpus(backend: str) -> list:
    if backend == "jax":
        import jax

        return [d for d in jax.devices() if d.platform == "gpu"]
    import tensorflow as tf

    return tf.config.list_physical_devices("GPU")


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure_memory(backend: str, name: str, mode: str, batch: int, steps: int) -> dict:
    """Peak memory of ``steps`` training batches of one configuration, in this process."""
    import overhead

    model = overhead.compile_model(overhead.build_model(name), mode, batch)
    x, y = overhead.make_data(name, batch, steps)
    gpus = _gpus(backend)
    if gpus and backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats("GPU:0")
        overhead.time_steps(model, x, y, batch, steps)
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        return {"what": "GPU peak bytes (TensorFlow get_memory_info)", "peak_mib": peak / 2**20}
    if gpus:  # JAX: the peak since the process started (a fresh process per configuration)
        overhead.time_steps(model, x, y, batch, steps)
        peak = gpus[0].memory_stats()["peak_bytes_in_use"]
        return {"what": "GPU peak bytes in use (JAX memory_stats)", "peak_mib": peak / 2**20}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_mib("VmRSS")  # after the reset: memory freed before it does not count
    overhead.time_steps(model, x, y, batch, steps)
    # The kernel syncs each thread's RSS counter lazily (a few dozen pages), so a fit that adds nothing can read a
    # hair below 0: that is 0 added.
    return {"what": "CPU peak RSS added by fit (MiB)", "peak_mib": max(0.0, _rss_mib("VmHWM") - before)}


def _memory(backend: str, name: str, batch: int, steps: int, fresh: bool) -> dict:
    out = {}
    for mode in MODES:
        if fresh:
            cmd = [sys.executable, __file__, "--_memory", backend, name, mode, str(batch), str(steps)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(backend))
            if proc.returncode:
                out[mode] = {"failed": True, "stderr_tail": proc.stderr[-500:]}
                continue
            out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            out[mode] = measure_memory(backend, name, mode, batch, steps)
    peaks = [out[m].get("peak_mib") for m in MODES]
    out["ratio"] = peaks[1] / peaks[0] if None not in peaks and peaks[0] > 0 else None
    return out


def run_backend(backend: str, plan: dict) -> dict:
    """Everything measured on one backend (this process has KERAS_BACKEND set)."""
    import overhead
    import padding

    overhead._KERAS["which"] = "3"
    gpus = _gpus(backend)
    result = {"device": [str(d) for d in gpus] or ["cpu"], "cases": {}, "padding": {}}
    for name, batch in plan["cases"]:
        if backend == "jax" and name in overhead.HUB_MODELS:
            continue  # the keras_hub models are timed on TensorFlow (issue 26's benchmark)
        timing = overhead.run_timing(name, batch, plan["steps"], 1, plan["rounds"], list(MODES), ("3",))
        case = {
            "batch": batch,
            "nonprivate_step_s": timing["nonprivate"]["median_step_s"],
            "dp_step_s": timing["fast"]["median_step_s"],
            "ratio": timing["fast"]["ratio"],
            "fallback_variables": timing["fast"].get("fallback_variables", []),
        }
        case["memory"] = _memory(backend, name, batch, plan["memory_steps"], fresh=bool(gpus))
        result["cases"][name] = case
    for name, lot in plan["padding"]:
        res = padding.run_padding(name, lot, plan["steps"], plan["rounds"], warmup_lots=plan["warmup_lots"])
        result["padding"][f"{name}/L={lot}"] = res
    return result


def _env(backend: str) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH")) if p)
    return env


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry", action="store_true", help="tiny shapes, one round, on CPU (the CI smoke test)")
    parser.add_argument("--out", required=True, help="where to write the JSON")
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax"], choices=["tensorflow", "jax"])
    parser.add_argument("--budget-s", type=float, default=450.0, help="wall-clock budget, shared by the backends")
    args = parser.parse_args(argv)
    plan = DRY if args.dry else FULL
    started = time.time()
    report = {
        "schema": SCHEMA,
        "what": "issue 41 item 8: DP (fast backend) / non-private step time and peak memory, Keras 3",
        "dry": args.dry,
        "load_average_start": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "backends": {},
    }
    for k, backend in enumerate(args.backends):
        env = _env(backend)
        if args.dry:
            env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, __file__, "--_backend", backend, json.dumps(plan)]
        share = (args.budget_s - (time.time() - started)) / (len(args.backends) - k)  # this backend's time
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(share, 1))
        except subprocess.TimeoutExpired:
            report["backends"][backend] = {"failed": True, "stderr_tail": f"timed out after {share:.0f} s"}
            continue
        if proc.returncode:
            report["backends"][backend] = {"failed": True, "stderr_tail": proc.stderr[-2000:]}
        else:
            report["backends"][backend] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["load_average_end"] = list(os.getloadavg())
    report["wall_s"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_backend"]:
        print(json.dumps(run_backend(sys.argv[2], json.loads(sys.argv[3]))))
    elif sys.argv[1:2] == ["--_memory"]:
        _, _, backend_name, model_name, mode_name, batch_s, steps_s = sys.argv
        import overhead

        overhead._KERAS["which"] = "3"
        print(json.dumps(measure_memory(backend_name, model_name, mode_name, int(batch_s), int(steps_s))))
    else:
        report = main()
        failed = [b for b, r in report["backends"].items() if r.get("failed")]
        sys.exit(1 if failed else 0)
