"""Alternate `verispec generate` runs over thread settings and runners, optionally under a background load of busy
processes, and print the median tok/s (the summary line on stderr) of each setting.

    python3 docs/bench/threads/bench.py --load 2 --reps 3 --threads default,1,2 --out after_load.json
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

CMD = ["verispec", "generate", "def quicksort(xs):", "--max-new-tokens", "64", "--temperature", "0"]
CMD += ["--draft", "none", "--seed", "0"]


def run(threads: str, runner: str, env: dict) -> float | None:
    cmd = CMD + ([] if threads == "default" else ["--threads", threads])
    cmd += [] if runner == "llamacpp" else ["--spec", f"runner={runner}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    m = re.search(r"([\d.]+) tok/s", p.stderr)
    if m is None:
        print(p.stderr[-2000:], flush=True)
    return float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", type=int, default=0, help="busy processes to run beside (python3 -c 'while True: pass')")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="default,1,2", help="settings: default (no flag) or a --threads value")
    ap.add_argument("--runners", default="llamacpp,fast")
    ap.add_argument("--env", default="", help="KEY=VAL;KEY=VAL set for the runs")
    ap.add_argument("--out")
    a = ap.parse_args()
    env = dict(os.environ) | dict(kv.split("=", 1) for kv in a.env.split(";") if kv)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.load)]
    res: dict[str, list] = {}
    try:
        time.sleep(1 if a.load else 0)
        for rep in range(a.reps):
            for runner in a.runners.split(","):
                for t in a.threads.split(","):
                    tps = run(t, runner, env)
                    res.setdefault(f"{runner}/{t}", []).append(tps)
                    print(rep, runner, t, tps, os.getloadavg()[0], flush=True)
    finally:
        for b in busy:
            b.kill()
            b.wait()
    ok = {k: [x for x in v if x is not None] for k, v in res.items()}
    summary = {k: {"runs": v, "median": statistics.median(ok[k]) if ok[k] else None} for k, v in res.items()}
    for k, v in summary.items():
        print(k, v["median"], v["runs"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(_provenance() | {"load": a.load, "env": a.env, "results": summary}, f, indent=1)


def _provenance() -> dict:
    """The commit (None: a tree with uncommitted changes), the date (UTC) and the CPU model of the run."""
    git = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        None,
    )
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {"commit": head if head and not git.stdout.strip() else None, "date": date, "cpu": cpu}


if __name__ == "__main__":
    main()
