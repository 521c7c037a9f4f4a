"""verispec_rollout_func's multi-process protocol without processes: accelerate's gather / broadcast replaced by
fakes for 4 training processes, a fake client. Groups straddle processes; one request is sent; each process gets its
slice; a failure on the main process is raised on every process."""

from __future__ import annotations

from types import SimpleNamespace

import accelerate.utils
import pytest
import torch

from verispec.rollout.trl import verispec_rollout_func

from ..helpers.tiny import make_tokenizer

G, PROCESSES = 4, 4
LOCAL = [["a b", "a b"], ["a b", "a b"], ["c d e", "c d e"], ["c d e", "c d e"]]  # each group on 2 processes


class FakeClient:
    def __init__(self, fail: bool = False):
        self.requests, self.updates, self.fail = [], 0, fail

    def update_weights(self, named):
        self.updates += 1
        assert all(t.dtype == torch.float32 for _, t in named)

    def generate(self, prompts, n, **kw):
        if self.fail:
            raise ValueError("server says no")
        self.requests.append((prompts, n, kw))
        entries = len(prompts) * n
        return {
            "prompt_ids": prompts,
            "completion_ids": [[k, k] for k in range(entries)],
            "logprobs": [[-float(k)] * 2 for k in range(entries)],
            "finish_reasons": ["length"] * entries,
            "weight_version": 1,
            "speculation": {},
        }


def _trainer(rank: int):
    model = torch.nn.Linear(2, 2)
    return SimpleNamespace(
        accelerator=SimpleNamespace(
            is_main_process=rank == 0, process_index=rank, unwrap_model=lambda m: m, num_processes=PROCESSES
        ),
        model=model,
        state=SimpleNamespace(global_step=0),
        num_generations=G,
        processing_class=make_tokenizer(),
        args=SimpleNamespace(
            seed=0, temperature=1.0, max_completion_length=8, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0
        ),
    )


def _run(monkeypatch, client) -> list:
    """Every process's result (or exception), the main process first (it broadcasts)."""
    shared = {}

    def gather(x: list) -> list:  # every process's list, concatenated in process order
        return [p for part in LOCAL for p in part] if isinstance(x[0], str) else [len(part) for part in LOCAL]

    monkeypatch.setattr(accelerate.utils, "gather_object", gather)

    def broadcast(objs, from_process=0):
        if "main" not in shared:
            shared["main"] = list(objs)
        return shared["main"]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", broadcast)
    out = []
    for rank in range(PROCESSES):
        func = verispec_rollout_func(client)
        try:
            out.append(func(LOCAL[rank], _trainer(rank)))
        except RuntimeError as e:
            out.append(e)
    return out


def test_one_request_for_all_processes_each_gets_its_slice(monkeypatch):
    client = FakeClient()
    outs = _run(monkeypatch, client)
    assert client.updates == 1 and len(client.requests) == 1  # from the main process only
    prompts, n, _ = client.requests[0]
    tok = make_tokenizer()
    assert n == G and prompts == [tok(text=["a b"])["input_ids"][0], tok(text=["c d e"])["input_ids"][0]]
    for rank, out in enumerate(outs):
        assert out["completion_ids"] == [[k, k] for k in (2 * rank, 2 * rank + 1)]
        assert out["prompt_ids"] == [prompts[rank // 2]] * 2


def test_a_failure_on_the_main_process_is_raised_on_every_process(monkeypatch):
    outs = _run(monkeypatch, FakeClient(fail=True))
    assert all(isinstance(o, RuntimeError) and "server says no" in str(o) for o in outs)


def test_prompts_not_in_groups_are_refused(monkeypatch):
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda x: list(x))
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda objs, from_process=0: objs)
    trainer = _trainer(0)
    with pytest.raises(RuntimeError, match="repeated num_generations times"):
        verispec_rollout_func(FakeClient())(["a", "b", "a", "b"], trainer)
