"""The server's admission defaults, in a module of their own so that the CLI reads them without importing the server
(`verispec --help` stays light)."""

DEFAULT_MAX_QUEUE = 1024  # choices (prompts x n) that may wait for a batch row: one RL step of 128 prompts x G = 8
DEFAULT_MAX_QUEUE_TOKENS = 1 << 18  # prompt tokens those waiting choices may hold (a group's shared prompt once)
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # a request still running after 10 minutes ends "abort" (--request-timeout)
ONLINE_SAVE_INTERVAL_S = 30.0  # --online-dir: a new head version is written at most this often (and at shutdown)
