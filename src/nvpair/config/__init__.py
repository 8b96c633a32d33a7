"""The config file, engine manifests, commands, cluster and group specs (no I/O).

The modules:

* ``manifest``: engine manifests (`engines/<kind>.json`): how each kind starts and is
  probed.
* ``command``: a managed engine's argv and environment from its template, never through a
  shell.
* ``cluster``: the `[cluster]` table and the peer settings it resolves to.
* ``keys``: `[[keys]]` and `token_file`, resolved to one `KeySpec` per key: name, role,
  limits, model patterns, and the token read from its file.
* ``settings``: `nvpair.toml`, decoded strictly, resolved to `Settings` and one `EngineSpec`
  per engine.
* ``diff``: what a reload changes: the running settings against new ones, per engine
  (unchanged, restart, update, added, removed) and per section.
* ``schema``: JSON Schemas of the config and the manifests, generated from the types.
* ``deploy``: the systemd unit nvpair ships (docs/deploy.md).
* ``group``: `[engines.group]`, resolved to `GroupSettings`: this node's rank and its role's
  start template (docs/groups.md).
"""
