"""Multi-node engine groups: one engine run across several nodes as one (docs/groups.md).

The modules sit in different layers (tests/test_layers.py): ``spec`` with the config,
``machine`` (the pure state machine and epoch rules) with the snapshot, ``runner`` with
supervision, ``view`` with the API, ``link`` with the peers.
"""
