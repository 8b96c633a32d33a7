"""One request to an engine, the probe loops and the model-list sweep.

The modules:

* ``answer``: an HTTP/1.1 answer read from its bytes (`AnswerReader`): a lean reader for the
  plain shape (a status line, a few headers, a `Content-Length` or none), h11 for any other;
  and `ExchangeError`.
* ``oneshot``: one HTTP/1.1 request on a connection of its own, on a plain non-blocking
  socket waited on with Trio's I/O manager, and closed (`exchange`, `send_request`,
  `encode_request`, `Target`): what a probe sends when no later probe would reuse its
  connection.
* ``probes``: one probe request and what its answer means (no loops, no timeouts).
* ``prober``: one engine's probe loops (liveness, identity), each under its deadline, and
  `run_probes`.
* ``kvcache``: an engine's KV-cache use read from its own `/metrics`, opt in
  (`watch_kv_cache`, `gauge_value`); never a health signal.
* ``sweep``: the model-list sweep: every due engine listed at once under one shared
  deadline; due times in a heap, and only the engines the board changed looked at again.
"""
