"""An HTTP client for `verispec serve`'s RL routes (`verispec.serve.rl`): rollouts by token ids with logprobs,
weight updates in the request body or from a path, abort. What a trainer process imports instead of vLLM's client.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence

import httpx
import torch

__all__ = ["RolloutClient", "RolloutServerError"]


def _chunks(body: bytes, size: int = 1 << 20):
    """A large body in 1 MiB views: httpx sends one bytes object by re-slicing what is left after each partial
    socket write, quadratic in its size (a 566 MB update took 55 s that way; in chunks, ~1.5 s)."""
    view = memoryview(body)
    for i in range(0, len(view), size):
        yield view[i : i + size]


class RolloutServerError(RuntimeError):
    """The server answered with an error (its message and HTTP status)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class RolloutClient:
    """A client of a `verispec serve` server's RL routes: rollouts by token ids, weight updates over HTTP.

    ```python
    with RolloutClient("http://127.0.0.1:8000") as client:
        client.wait_for_server()
        out = client.generate([[1, 2, 3]], n=8, temperature=1.0, max_tokens=64, seed=0)
        client.update_weights(model.named_parameters())
    ```

    Every call raises `RolloutServerError` (with the HTTP status and the server's message) when the server
    answers with an error.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        timeout: float | None = 600.0,
        generate_timeout: float | None = 3600.0,
        api_key: str | None = None,
    ):
        """A client of the server at `base_url`.

        Args:
            base_url: The server's address.
            timeout: Seconds for each call but `generate` (None: no limit).
            generate_timeout: Seconds for `generate` (None: no limit). A generate whose client gives up is aborted
                on the server.
            api_key: The server's --api-key, sent as a Bearer token (default: $VERISPEC_API_KEY).
        """
        self.base_url = base_url.rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("VERISPEC_API_KEY")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers)
        self.generate_timeout = generate_timeout

    def close(self) -> None:
        """Close the HTTP connection pool (a `with` block does it)."""
        self._http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw) -> dict:
        r = self._http.request(method, path, **kw)
        if r.status_code != 200:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise RolloutServerError(r.status_code, message)
        return r.json()

    def wait_for_server(self, timeout: float = 60.0, interval: float = 0.5) -> None:
        """Poll /health/ until the server answers.

        Args:
            timeout: Seconds to wait.
            interval: Seconds between polls.

        Raises:
            ConnectionError: No server answered within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._http.get("/health/", timeout=interval + 1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(f"no verispec server answered at {self.base_url} within {timeout} s")
            time.sleep(interval)

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        max_tokens: int = 16,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        **options,
    ) -> dict:
        """POST /generate/: n samples per prompt (sample j of prompt i seeded by `SeedSequence([seed, i, j])`).

        Args:
            prompts: Token id lists, or texts.
            n: Samples per prompt.
            temperature: The sampling temperature.
            max_tokens: Each sample's budget of new tokens.
            seed: The request seed (None: the server draws one).
            stop: Stop strings.
            **options (Any): top_p, top_k, min_p, repetition_penalty (refused by the server unless neutral: the
                trainer could not recompute its logprobs), truncate_prompt_tokens, ignore_eos.

        Returns:
            The server's reply: `prompt_ids`, `completion_ids`, `logprobs` (prompt-major, n per prompt),
            `finish_reasons`, `weight_version` and `speculation`.

        Raises:
            RolloutServerError: The server refused the request (a 400 names the field) or failed.
        """
        kwargs = {"seed": seed, "stop": list(stop) if stop else None}
        if "ignore_eos" in options:
            kwargs["ignore_eos"] = options.pop("ignore_eos")
        body = {
            "prompts": [p if isinstance(p, str) else [int(t) for t in p] for p in prompts],
            "n": n,
            "temperature": temperature,
            "max_tokens": max_tokens,
            "generation_kwargs": kwargs,
            **options,
        }
        return self._call("POST", "/generate/", json=body, timeout=self.generate_timeout)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict:
        """POST /update_weights_from_tensor with every tensor in one safetensors body.

        Args:
            named_tensors: (name, tensor) pairs, sent as they are (cast them to the served model's dtype first).

        Returns:
            The server's reply: `weight_version`, `tensors`, `seconds`, `requantize_seconds`.

        Raises:
            RolloutServerError: The server refused the update (403 without --enable-weight-updates; 400 for a bad
                tensor, and then nothing changed).
        """
        from safetensors.torch import save  # a transformers dependency

        tensors, seen = {}, set()
        for name, t in named_tensors:
            t = t.detach().to("cpu").contiguous()
            if t.data_ptr() in seen:  # tied weights (a state_dict names them twice): safetensors wants copies
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        body = save(tensors)
        headers = {"content-type": "application/octet-stream", "content-length": str(len(body))}
        return self._call("POST", "/update_weights_from_tensor", content=_chunks(body), headers=headers)

    def update_weights_from_disk(self, path: str) -> dict:
        """POST /update_weights_from_disk: the server reads a safetensors checkpoint on its own disk.

        Args:
            path: A safetensors file or directory on the server, under one of its --weight-dir folders.

        Returns:
            The server's reply, as `update_weights`.

        Raises:
            RolloutServerError: The server refused the update.
        """
        return self._call("POST", "/update_weights_from_disk", json={"model_path": str(path)})

    def weight_version(self) -> int:
        """GET /get_weight_version: the served model's weight version."""
        return int(self._call("GET", "/get_weight_version")["weight_version"])

    def abort(self) -> None:
        """End the server's running /generate/ after its current step."""
        self._call("POST", "/abort_request", json={})

    def reset_prefix_cache(self) -> None:
        self._call("POST", "/reset_prefix_cache/")
