"""Process-wide tuning a reader may skip: the wake grid, the collector, loop lag.

The modules:

* ``looplag``: the opt-in loop-lag probe (`NVPAIR_LOOP_LAG_FILE`) the benchmarks read.
* ``wakes``: periodic loops wake on a grid shared by the process (timer coalescing:
  `Ticker`, `grid_for`; the probe loops pass the node's probe rate in), so an idle node
  wakes seldom; each loop keeps its number of ticks, late by at most a tenth of a probe's
  interval. The loops asleep until one grid point are woken by one timer task of the run
  (`sleep_until`), not each by a deadline and a cancel scope of its own.
* ``collector``: how the cyclic garbage collector runs: what is alive frozen as each
  automatic collection of the young generations ends, the young generation held to 2,000
  objects by a look at its size (the dying frozen objects hide it from CPython's count), a
  full collection only when nvpair's memory grew by a quarter (`Collector`); on CPython
  before 3.14 only (3.14's incremental collector has no generation 1: `left_alone` says so
  at start).
* ``spanexport``: spans to an OTLP/HTTP collector from a bounded buffer a worker thread
  drains, dropped and counted when the collector is slow, hung or gone (`SpanExporter`);
  the exporter of now, which a reload of `[tracing]` switches (`SpanExport`).
"""
