"""The snapshot and its state machines, where writers and readers meet (no I/O).

The modules:

* ``snapshot``: `EngineState`, `Snapshot` and the `Board` that publishes them, with its two
  versions (every change, and the listing).
* ``transitions``: the engine state machine as pure functions (`after_liveness`,
  `after_identity`, `after_models`, ...) and the liveness loop's next tick
  (`next_interval`).
* ``traffic``: what real requests showed: in-flight counts, outcomes, suspects, passive
  health.
* ``listing``: the model items (`ModelItem`), kept engine by engine per listing version, and
  `/v1/models` encoded per engine.
* ``group``: a multi-node group's states and epoch rules as pure functions, and its restart
  budget.
* ``events``: the change journal of `GET /v1/events`: content changes numbered per boot, a
  ring for resuming, one latest value per key per stream.
* ``memory``: what the memory watch publishes (`EngineMemory`, `NodeMemory`) and their
  status documents; never listed.
* ``history``: `History`, the last hour of each engine's probe latency and memory, in
  bounded buckets, for the dashboard's charts; each look takes only the engines the board
  changed since the last (`Board.touched`).
"""
