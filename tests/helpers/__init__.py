"""Helpers shared by the tests: plain modules, never test modules (no `test_*` names, no tests in them).

A test module imports what it shares from here (`from ..helpers.tiny import make_model`), or takes a fixture from
`tests/conftest.py`; it never imports another test module.

* `tiny`: tiny random models (Llama, Qwen2, Qwen3, Mistral; vocabulary 32) and their word-level tokenizer
* `saved`: the tiny target and its noisy draft saved to a folder; strict JSON reading
* `server`: `LiveServer`, a `verispec serve` app on 127.0.0.1 in a thread
* `sequences`: the engine's first-3-token distribution against the target's exact one (chi-square)
* `toy_lm`: a prefix-dependent toy p / q over a few tokens, for exact laws by enumeration
* `mixed_root`: the exact first-token law of a mixed tree root (chosen + sampled child)
* `chain_harness`: the chain tests' (p, q) cases through the kernel certifier's machinery
* `ray_engines`: picklable engine factories for the Ray tests (replica processes import them)
"""
