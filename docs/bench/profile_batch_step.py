"""Profile batch-B speculative decoding steps (prefill excluded) on the Qwen pair: per step, the target forward,
the draft forwards and everything else (verification, sampling, bookkeeping), plus the top non-model functions."""

import cProfile
import os
import pstats
import sys
import time

import torch

from verispec.bench.e2e import load_prompts
from verispec.data import prompt_file
from verispec.engine.config import SpecConfig
from verispec.engine.generator import SpeculativeGenerator
from verispec.model.loading import load_model
from verispec.sampling import SamplingParams

torch.set_num_threads(2)
try:  # the commit, date and command of this run; an older checkout has no such helper
    from verispec.bench import provenance, provenance_line

    print(f"Made by {provenance_line(provenance())}\n")
except ImportError:
    print("Made by an older checkout (no verispec.bench.provenance)\n")
MODELS = os.path.expanduser(sys.argv[1] if len(sys.argv) > 1 else "~/models")  # fetch.sh DIR qwen-pair
PROMPTS = sys.argv[2] if len(sys.argv) > 2 else "code"
target = load_model(f"{MODELS}/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
draft = load_model(f"{MODELS}/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
prompts = load_prompts([prompt_file(PROMPTS)])["code"]  # a file, or a built-in set's name
gen = SpeculativeGenerator(target, draft, config=SpecConfig.parse("draft=model,quant=int4,gamma=4,runner=fast"))
acc = {}


def timed(obj, name):
    f = obj.forward

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        acc[name] = acc.get(name, 0) + time.perf_counter() - t
        return out

    obj.forward = wrapper


timed(gen.core.runner, "target")
timed(gen.core.proposer.runner, "draft")
MODEL = ("fast.py", "linear.py", "cache.py", "mkldnn", "int4pack", "scaled_dot", "_rms_norm", "silu", "runner.py")
for B in (4, 8):
    sess = gen.session()
    for i in range(B):
        sess.add(prompts[i], SamplingParams(temperature=1.0, seed=i), max_new_tokens=40, chat=True, ignore_eos=True)
    sess.step()  # admission + prefill + first step: not profiled
    acc.clear()
    steps = 0
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    while sess.num_active and steps < 8:
        sess.step()
        steps += 1
    pr.disable()
    wall = time.perf_counter() - t0
    other = wall - sum(acc.values())
    print(
        f"### batch {B}: {steps} steps, {wall / steps * 1e3:.0f} ms per step: target forward "
        f"{acc['target'] / steps * 1e3:.0f} ms ({acc['target'] / wall:.0%}), draft forwards {acc['draft'] / steps * 1e3:.0f} ms "
        f"({acc['draft'] / wall:.0%}), everything else {other / steps * 1e3:.1f} ms ({other / wall:.1%})"
    )
    st = pstats.Stats(pr)
    rows = [(v[2], f"{k[0].split('/')[-1]}:{k[1]}({k[2]})", v[1]) for k, v in st.stats.items()]
    rows = [r for r in rows if not any(m in r[1] for m in MODEL)]
    rows.sort(reverse=True)
    print("top non-model functions by own time (ms per step, calls per step):")
    for tt, name, calls in rows[:12]:
        print(f"  {tt / steps * 1e3:7.2f} ms  {calls / steps:6.1f}  {name}")
    sys.stdout.flush()
