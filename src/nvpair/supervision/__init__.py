"""Engine processes: start, stop, restart, orphans, memory watch, group ranks.

The modules:

* ``memtrend``: the leak detector (`TrendDetector`): bucket floors, Theil-Sen slope, Mann-
  Kendall, time to exhaustion.
* ``memproc``: parsers and readers of `/proc/PID/status`, `/proc/meminfo`, PSI, cgroup v2
  memory files and `/proc/net/tcp` (`read_status`, `listening_pids`, `scan`;
  `parse_listening`, the one `/proc/net/tcp` parser, also serves
  `nvpair.supervision.group.listening`).
* ``process``: one engine process: spawn, copy its output, stop (signal, grace, SIGKILL),
  reap.
* ``lifecycle``: `EngineRunner`: start, stop, restart and backoff of one engine, managed or
  adopted.
* ``fleet``: `Fleet`: the runners as a set that changes while nvpair runs (a reload): each
  in a cancel scope of its own, replaced or removed after a drain.
* ``sleeper``: `Sleepers`: engines' wake and sleep (docs/sleep.md): single-flight wakes,
  a drain before each sleep, the kind's calls in order.
* ``orphans``: state files of the processes nvpair starts, so a later nvpair stops what a
  killed one left.
* ``kept``: engines that outlive nvpair (`on_exit = "keep"`): the output file followed
  (`OutputTail`), and a process adopted from a previous nvpair's record (`AdoptedProcess`).
* ``memwatch``: `MemoryWatch`: each engine's processes, a reading tick off the loop, the
  trend, exits explained (`explain_exit`), `restart_when_quiet`.
* ``group``: `GroupRunner`, this node's role in a multi-node group: the head's decisions or
  a rank's reconciling, its process per epoch, `Reports` for the advert.
"""
