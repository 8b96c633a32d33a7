"""Entry point: parse and dispatch. Bad input ends with one line, never a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from nvpair import __version__
from nvpair.errors import InputError

DESCRIPTION = """\
nvpair runs beside LLM inference engines (SGLang, vLLM, llama.cpp, Ollama, TGI, any
OpenAI-compatible server), probes them on a fixed budget and answers at once what runs
where. Reads never wait on an engine."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvpair", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"nvpair {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def config_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", "-c", metavar="FILE",
                       help="config file (default: $NVPAIR_CONFIG, else ./nvpair.toml, "
                            "else an embedded default that adopts engines on their default ports)")

    p = sub.add_parser("serve", help="run nvpair: probe the engines and serve the API")
    config_arg(p)
    p.add_argument("--listen", metavar="HOST:PORT", help="override the config's listen address")
    p.add_argument("--log-format", choices=("text", "json"),
                   help="nvpair's log lines: text (for people, the default) or json (one "
                        "object per line); overrides the config's log_format")
    p.add_argument("--watch-config", action="store_true",
                   help="reload the config when its file changes (noticed within 2 s; "
                        "docs/lifecycle.md)")

    p = sub.add_parser("check", help="validate the config and manifests; show what nvpair would do")
    config_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--show-commands", action="store_true",
                   help="also print each managed engine's exact argv and environment")

    p = sub.add_parser("schema", help="print the JSON Schema of the config or of a manifest, "
                                      "or the API's OpenAPI document")
    p.add_argument("what", choices=("config", "manifest", "api"))

    p = sub.add_parser("demo", help="run nvpair with simulated engines (no GPU needed)")
    p.add_argument("--listen", metavar="HOST:PORT", default="127.0.0.1:14322")

    sub.add_parser("sim", help="run an engine simulator (see `nvpair sim --help`)", add_help=False)

    p = sub.add_parser("unit", help="print a systemd unit that runs this nvpair (docs/deploy.md)")
    p.add_argument("--config", "-c", metavar="FILE", help="the config it serves "
                   "(default /etc/nvpair/nvpair.toml)")
    p.add_argument("--user", metavar="NAME", help="the user it runs as (default nvpair)")
    p.add_argument("--on-exit", choices=("stop", "keep"),
                   help="what a stop or restart of the unit does to the engines (default: "
                        "keep if the config keeps any engine, else stop)")

    p = sub.add_parser("stop-engines", help="stop every managed engine on record, nvpair "
                                            "running or not (on_exit = keep: docs/lifecycle.md)")
    config_arg(p)
    p.add_argument("--url", help="a running nvpair's base URL (default: from the config's "
                                 "listen)")
    p.add_argument("--systemd-unit", metavar="UNIT",
                   help="as UNIT's ExecStop=: stop only for a stop job of UNIT, not while "
                        "systemd restarts it or after nvpair crashed (docs/deploy.md)")

    for name, helptext in (
        ("status", "show the engines of a running nvpair"),
        ("reload", "read the config again and apply what changed, restarting only the "
                   "engines whose process changed (docs/lifecycle.md)"),
        ("models", "list the models a running nvpair serves"),
        ("start", "start an engine (managed engines)"),
        ("stop", "stop an engine"),
        ("restart", "restart an engine"),
        ("drain", "stop an engine once its requests in flight have finished"),
        ("wake", "wake a sleeping engine, or what serves a model (docs/sleep.md)"),
        ("sleep", "put an engine to sleep once its requests in flight have finished"),
        ("logs", "show an engine's output"),
        ("events", "print a running nvpair's events as they come, one line each"),
        ("memory", "show each engine's memory: floor, slope, when it runs out"),
        ("groups", "show multi-node groups, or stop, start or restart one (docs/groups.md)"),
    ):
        p = sub.add_parser(name, help=helptext)
        config_arg(p)
        p.add_argument("--url", help="nvpair's base URL (default: from the config's listen)")
        if name in ("start", "stop", "restart", "drain", "wake", "sleep", "logs"):
            p.add_argument("name", help="engine name, or (wake) a model's id"
                           if name == "wake" else "engine name")
        if name in ("status", "memory"):
            p.add_argument("name", nargs="?", help="one engine (default: all)")
        if name == "logs":
            p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
            p.add_argument("-n", "--tail", type=int, default=100,
                           help="lines to show (default 100)")
        if name in ("status", "models", "events", "memory"):
            p.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "status":
            p.add_argument("--watch", "-w", action="store_true",
                           help="keep the table on screen, redrawn when something changes")
        if name == "events":
            p.add_argument("--types", metavar="T,T", help="only these: engine, models, peer")
            p.add_argument("--engine", metavar="NAME", help="only this engine's events")
        if name == "models":
            p.add_argument("--cluster", action="store_true", help="include peers' models")
        if name == "groups":
            p.add_argument("name", nargs="?", help="one group (default: all)")
            p.add_argument("action", nargs="?", choices=("stop", "start", "restart"),
                           help="ask the group's head to stop, start or restart it")
            p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["sim"]:
        from nvpair.sim import cli as sim_cli  # the simulators: imported only when used

        return sim_cli.main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return dispatch(args)
    except InputError as exc:
        print(f"nvpair: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `nvpair logs -f | head`: the reader is gone, and so are we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _config_on_exit(config: str) -> str:
    """"keep" if the config (when it can be read) keeps any managed engine, else "stop"."""
    from nvpair.config.settings import load_settings

    try:
        settings = load_settings(config) if os.path.isfile(config) else None
    except InputError:
        return "stop"
    # (a group's head never keeps its process: docs/groups.md)
    keeps = settings is not None and any(e.on_exit == "keep" and not (
        e.group is not None and e.group.rank == 0) for e in settings.engines)
    return "keep" if keeps else "stop"


def dispatch(args: argparse.Namespace) -> int:
    from nvpair.config.settings import Settings, load_settings

    if args.command == "check":
        from nvpair.cli import check

        # a warning while the config is read gets its prefix, like check's own
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
        logging.addLevelName(logging.WARNING, "warning")
        return check.run(load_settings(args.config), as_json=args.json,
                         show_commands=args.show_commands)
    if args.command == "schema":
        if args.what == "api":  # every optional part (router, peers, groups) included
            from nvpair.openapi import document_json

            sys.stdout.write(document_json().decode() + "\n")
            return 0
        from nvpair.config.schema import schema_json

        sys.stdout.write(schema_json(args.what) + "\n")
        return 0
    if args.command == "serve":
        import msgspec

        from nvpair.cli.serve import run_serve

        def load() -> Settings:  # (a reload reads it again the same way)
            settings = load_settings(args.config, listen=args.listen)
            if args.log_format:
                settings = msgspec.structs.replace(settings, log_format=args.log_format)
            return settings

        settings = load()
        watched = None
        if args.watch_config:
            from nvpair.config.settings import find_config_path

            watched = find_config_path(args.config)
            if watched is None:
                raise InputError("--watch-config: no config file to watch (give --config)")
        return run_serve(settings, load=load, watch_config=watched)
    if args.command == "unit":
        from nvpair.config.deploy import unit_text

        config = args.config or "/etc/nvpair/nvpair.toml"
        on_exit = args.on_exit or _config_on_exit(config)
        sys.stdout.write(unit_text(config=args.config, user=args.user, on_exit=on_exit))
        if not os.path.isfile(config):  # the unit is still printed: it may be written later
            print(f"nvpair: warning: {config} does not exist yet; write it, then run "
                  f"`nvpair check --config {config} --show-commands` as the unit's user",
                  file=sys.stderr)
        return 0
    if args.command == "stop-engines":
        from nvpair.cli import stop_engines

        return stop_engines.run(load_settings(args.config), args)
    if args.command == "demo":
        from nvpair.cli.demo import run_demo

        return run_demo(args.listen)
    from nvpair.cli import client

    return client.run(args)
