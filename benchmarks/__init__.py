"""nvpair's benchmarks: ``python -m benchmarks [--quick]`` (``nox -s bench``).

Every scenario of issue 6 runs in one invocation, so the ratios compare numbers taken on the
same (shared, noisy) machine within minutes of each other. nvpair, the simulators, the
reference implementation of the design that failed (:mod:`benchmarks.baseline`), the
floor servers (:mod:`benchmarks.floor`) and the load generators each run as their own
process, so the CPU time and RSS read from ``/proc`` belong to the process measured.

Modules: ``procs`` (processes and /proc), ``httpc`` (a minimal HTTP/1.1 client on Trio),
``pollers`` (the report's pollers and back-to-back clients, as a process), ``baseline``,
``floor``, ``wrk`` (load generator), one module per scenario (``replay``, ``scale``,
``models``, ``throughput``, ``soak``), ``targets`` and ``report``. Many simulated engines
run in a few processes with ``python -m nvpair.sim farm`` (:mod:`nvpair.sim.farm`); nvpair's
loop lag comes from its opt-in probe (``NVPAIR_LOOP_LAG_FILE``, :mod:`nvpair.runtime.looplag`).
"""
