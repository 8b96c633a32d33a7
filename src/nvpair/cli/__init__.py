"""The ``nvpair`` command line.

The modules:

* ``main``: parse and dispatch; bad input ends in one line, never a traceback.
* ``serve``: `nvpair serve`.
* ``demo``: `nvpair demo`: nvpair with simulated engines as child processes.
* ``check``: `nvpair check`: validate the config and say what would run, with probe rates.
* ``preflight``: what would make an engine fail at `serve`, known without starting it: port
  clashes, a program not on the PATH, a missing model file (`nvpair check` fails on it;
  `serve` logs it).
* ``client``: the commands that talk to a running nvpair (status, models, start, stop,
  logs).
* ``stop_engines``: `nvpair stop-engines`: every engine on record stopped, through a running
  nvpair's API or, its nvpair gone, from its record.
* ``groups``: `nvpair groups`: multi-node groups' states, ranks and epochs; stop, start,
  restart.
* ``memory``: `nvpair memory [NAME]`: each engine's memory, floor, slope and time to
  exhaustion, for a person.
* ``events``: `nvpair events` and `nvpair status --watch`, read from `GET /v1/events` and
  resumed after a dropped connection.
* ``progress``: engine state changes printed while `nvpair serve` runs.
* ``table``: plain tables, coloured only on a terminal.
"""
