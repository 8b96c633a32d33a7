"""Build a managed engine's argv and environment from its template. Never through a shell.

Each template element is one argv element; a placeholder such as ``{model}`` is replaced by
text inside that element, so no value can ever become extra arguments or shell syntax.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping

from nvpair.config.manifest import Manifest, StartSpec
from nvpair.errors import CommandError as CommandError  # build_command raises it

_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)\}")

#: environment variables nvpair reads a secret from: an engine never inherits them (it gets
#: one only when its own ``env`` in the config sets it).
SECRET_ENV = frozenset({"NVPAIR_TOKEN"})


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def fill(template: str, values: Mapping[str, object]) -> str:
    missing = [n for n in _PLACEHOLDER.findall(template) if n not in values]
    if missing:
        raise KeyError(missing[0])
    return _PLACEHOLDER.sub(lambda m: _text(values[m[1]]), template)


def build_command(
    manifest: Manifest, command: tuple[str, ...] | None, values: Mapping[str, object]
) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment). Raises CommandError naming a placeholder with no value."""
    start, where = start_spec(manifest, values)
    where = "command" if command else where
    template = list(command or start.argv)
    if not template:
        raise CommandError("no command: give `command` or a manifest with start.argv")
    argv = []
    for part in template:
        try:
            argv.append(fill(part, values))
        except KeyError as exc:
            raise CommandError(
                f"{where} needs a value for {{{exc.args[0]}}}: set it in the engine's "
                f"config (model, host, port) or under [engines.args]"
            ) from None
    if not command:
        for fragment in start.optional:
            try:
                filled = [fill(part, values) for part in fragment]
            except KeyError:
                continue  # optional: left out unless every placeholder has a value
            argv.extend(filled)
    if not command and values.get("sleep") is True and manifest.sleep is not None:
        for fragment in manifest.sleep.argv:  # (docs/sleep.md: the kind's sleep flags)
            try:
                filled = [fill(part, values) for part in fragment]
            except KeyError:
                continue
            argv.extend(filled)
    env = {}
    if values.get("sleep") is True and manifest.sleep is not None:
        env.update(manifest.sleep.env)
    for key, template_value in start.env.items():
        try:
            env[key] = fill(template_value, values)
        except KeyError as exc:
            raise CommandError(f"start.env.{key} needs a value for {{{exc.args[0]}}}") from None
    for key, template_value in start.optional_env.items():
        with contextlib.suppress(KeyError):  # optional: left out unless it has its values
            env[key] = fill(template_value, values)
    return argv, env


#: the args that make an engine a multi-model router (``Manifest.router_start``)
ROUTER_ARGS = ("models_dir", "models_preset")


def start_spec(manifest: Manifest, values: Mapping[str, object]) -> tuple[StartSpec, str]:
    """The start template for these values, and its name for errors: the router's when
    the manifest has one and the args name a models dir or preset, else ``start``."""
    if manifest.router_start is not None and any(k in values for k in ROUTER_ARGS):
        return manifest.router_start, f"the {manifest.kind} manifest's router_start.argv"
    return manifest.start, f"the {manifest.kind} manifest's start.argv"


def key_in_argv(manifest: Manifest, command: tuple[str, ...] | None) -> bool:
    """Whether the argv built from this template holds the API key (``{api_key}``), where
    any local user can read it (``ps``, ``/proc/PID/cmdline``): SGLang takes its key only
    there, and a custom command may put it there. ``nvpair check`` warns of it."""
    starts = [manifest.start, *([manifest.router_start] if manifest.router_start else [])]
    template = command or tuple(part for start in starts for part in (
        *start.argv, *(p for fragment in start.optional for p in fragment)))
    return any("{api_key}" in part for part in template)


def engine_env(inherited: Mapping[str, str], template_env: Mapping[str, str],
               config_env: Mapping[str, str]) -> dict[str, str]:
    """A managed engine's environment: nvpair's own without its secrets, then the
    manifest's ``start.env``, then the engine's ``env`` from the config (which wins)."""
    env = {k: v for k, v in inherited.items() if k not in SECRET_ENV}
    env.update(template_env)
    env.update(config_env)
    return env
