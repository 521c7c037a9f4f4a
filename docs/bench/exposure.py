"""Issue 29's findings, request by request, against a default `verispec serve` (the built-in model, no flags): run it
before and after a change and compare the tables.

    python3 docs/bench/exposure.py                         # this checkout
    python3 docs/bench/exposure.py --pythonpath OLD/src    # another checkout's code

Starts the server as a subprocess on 127.0.0.1, sends each request (printed in the table), and prints one markdown
row per finding: the status and the start of the answer, or the measured figure (the server's peak memory from
/proc, /health's worst latency while another request is parsed, a request's time with and without 10,000 stop
strings, how many distinct texts one seeded request gave under load and different draft lengths)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import torch
from safetensors.torch import save

URL = "http://127.0.0.1:{port}"
MODEL = {"id": "x"}  # the served model's id, read from /v1/models


def _short(r: httpx.Response) -> str:
    text = r.text.replace("\n", " ").replace("|", "/")
    return f"{r.status_code} {text[:110]}"


def _peak_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _health_worst(url: str, busy: threading.Thread) -> float:
    """The worst /health latency (s) while `busy` runs."""
    worst = 0.0
    busy.start()
    while busy.is_alive():
        t = time.perf_counter()
        httpx.get(url + "/health", timeout=600)
        worst = max(worst, time.perf_counter() - t)
        time.sleep(0.02)
    return worst


def _weights(url: str) -> list[tuple[str, str]]:
    body = save({"not.a.weight": torch.zeros(1)})
    octets = {"content-type": "application/octet-stream"}
    return [
        ("POST /update_weights_from_disk {model_path: /etc/passwd}",
         _short(httpx.post(url + "/update_weights_from_disk", json={"model_path": "/etc/passwd"}))),
        ("POST /update_weights_from_disk {model_path: /no/such/dir}",
         _short(httpx.post(url + "/update_weights_from_disk", json={"model_path": "/no/such/dir"}))),
        ("POST /update_weights_from_tensor (a safetensors body, no key)",
         _short(httpx.post(url + "/update_weights_from_tensor", content=body, headers=octets))),
        ("GET /v1/models, Host: evil.example (DNS rebinding)",
         _short(httpx.get(url + "/v1/models", headers={"host": "evil.example"}))),
        ("POST /abort_request, no body (what a cross-site form can send)",
         _short(httpx.post(url + "/abort_request"))),
    ]  # fmt: skip


def _bodies(url: str, pid: int) -> list[tuple[str, str]]:
    before = _peak_mb(pid)

    def chunks():
        yield b'{"model": "%s", "prompt": "' % MODEL["id"].encode()
        for _ in range(256):
            yield b"a" * (256 << 10)  # 64 MiB in all, chunked: no Content-Length

    try:
        r = _short(httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}))
    except httpx.HTTPError as e:
        r = f"connection closed ({type(e).__name__})"
    return [
        ("POST /v1/completions, a chunked 64 MiB body", f"{r}; server peak memory +{_peak_mb(pid) - before:.0f} MB")
    ]


def _uploads(url: str, pid: int) -> list[tuple[str, str]]:
    """8 concurrent 64 MiB weight uploads (valid safetensors, names the model lacks: refused after parsing)."""
    body = save({"not.a.weight": torch.zeros(16 << 20)})  # 64 MiB of float32
    octets = {"content-type": "application/octet-stream"}
    before, answers = _peak_mb(pid), []

    def one():
        answers.append(httpx.post(url + "/update_weights_from_tensor", content=body, headers=octets, timeout=600))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted({r.status_code for r in answers})
    return [
        (
            "8 concurrent 64 MiB POST /update_weights_from_tensor",
            f"{codes}; server peak memory +{_peak_mb(pid) - before:.0f} MB",
        )
    ]


def _loop(url: str) -> list[tuple[str, str]]:
    prompt = "hello world, this is a test of things. " * 50_000  # 1.9 MB
    out = {}
    busy = threading.Thread(
        target=lambda: out.setdefault(
            "r",
            httpx.post(
                url + "/v1/completions", json={"model": MODEL["id"], "prompt": prompt, "max_tokens": 1}, timeout=600
            ),
        )
    )
    worst = _health_worst(url, busy)
    return [
        ("/health while a 1.9 MB prompt is tokenized", f"worst /health {worst * 1000:.0f} ms ({_short(out['r'])[:60]})")
    ]


def _surrogates(url: str) -> list[tuple[str, str]]:
    h = {"content-type": "application/json"}
    return [
        ('POST /v1/completions {"prompt": "\\ud800"}',
         _short(httpx.post(url + "/v1/completions", content='{{"model": "{}", "prompt": "\\ud800"}}'.format(MODEL["id"]), headers=h))),
        ('POST /tokenize {"prompt": "\\ud800"}',
         _short(httpx.post(url + "/tokenize", content='{"prompt": "\\ud800"}', headers=h))),
        ("POST /generate/ {generation_kwargs: {seed: 2**64}}",
         _short(httpx.post(url + "/generate/", json={"prompts": ["a"], "generation_kwargs": {"seed": 2**64}}))),
    ]  # fmt: skip


def _stops(url: str) -> list[tuple[str, str]]:
    body = {
        "model": MODEL["id"],
        "prompt": "Count from 1 to 100:",
        "max_tokens": 64,
        "temperature": 0,
        "ignore_eos": True,
    }
    stops = [f"never-{i}-zz" for i in range(10_000)]
    times = {}
    for name, extra in (("none", {}), ("10k", {"stop": stops}), ("none ", {}), ("10k ", {"stop": stops})):
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body | extra, timeout=600)
        times.setdefault(name.strip(), []).append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
    a, b = min(times["none"]), min(times["10k"])
    return [("64 tokens, 10,000 stop strings vs none (best of 2)", f"{b:.2f} s vs {a:.2f} s: {b / a:.2f}x")]


def _seeded(url: str) -> list[tuple[str, str]]:
    body = {"model": MODEL["id"], "prompt": "a b c a b c a b c a b", "max_tokens": 48, "temperature": 1.0, "seed": 7}
    load = {"model": MODEL["id"], "prompt": "Tell me a story.", "max_tokens": 64, "temperature": 1.0, "n": 2}
    texts, errors = set(), []

    def one(extra):
        r = httpx.post(url + "/v1/completions", json=body | extra, timeout=600)
        (texts.add(r.json()["choices"][0]["text"]) if r.status_code == 200 else errors.append(r.text))

    for gamma in (None, 1, 3, 6, None):
        noise = [threading.Thread(target=lambda: httpx.post(url + "/v1/completions", json=load, timeout=600))
                 for _ in range(2)]  # fmt: skip
        for t in noise:
            t.start()
        one({} if gamma is None else {"num_speculative_tokens": gamma})
        for t in noise:
            t.join()
    what = f"{len(texts)} distinct text(s) from 5 calls" + (f"; errors: {errors[:1]}" if errors else "")
    return [("one seeded request, 5 times under load, gamma auto / 1 / 3 / 6 / auto", what)]


def _made_by() -> str:
    """The commit, date and command of this run (`verispec.bench.provenance`); an older checkout has no such helper."""
    try:
        from verispec.bench import provenance, provenance_line
    except ImportError:
        return "Made by an older checkout (no verispec.bench.provenance)"
    return f"Made by {provenance_line(provenance())}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pythonpath", help="run the server from this source tree (e.g. an old checkout's src)")
    ap.add_argument("--port", type=int, default=8731)
    ap.add_argument("--serve-args", default="", help="more `verispec serve` flags, e.g. --enable-weight-updates")
    args = ap.parse_args()
    made_by = _made_by()  # this script's checkout; the server's code is --pythonpath's where given
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(args.port), "--spec", "runner=fast"]
    cmd += args.serve_args.split()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = URL.format(port=args.port)
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        MODEL["id"] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        rows = (
            _weights(url)
            + _bodies(url, proc.pid)
            + _uploads(url, proc.pid)
            + _loop(url)
            + _surrogates(url)
            + _stops(url)
            + _seeded(url)
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    print(f"{made_by}\n\n| request | answer |\n|---|---|")
    for request, answer in rows:
        print(f"| {request} | {answer} |")
    if "Traceback" in err:
        print("\nserver log had a traceback:\n```\n" + err[-1500:] + "\n```")


if __name__ == "__main__":
    main()
