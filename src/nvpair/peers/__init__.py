"""The peers broker: every node keeps the cluster's models in memory, fed by a background
channel (HTTP push between nodes, or etcd), so a cluster listing never calls out.

Module map: ``advert`` (what a node says about itself), ``table`` (the peer table and its
states; the API's ``ClusterView``), ``receiver`` (``POST /v1/peers/adverts``), ``status``
(``GET /v1/peers``), ``push`` (one pusher per peer), ``gateway`` (etcd's v3 JSON gateway),
``etcd`` (the etcd backend), ``broker`` (builds and runs the lot for the service). See
docs/peers.md.

The ``[cluster]`` table is config (``nvpair.cluster``); peers read what it resolves to and
sit above the ``asgi`` helpers and the router's ``peering`` protocol, never below the API:
nothing here imports ``nvpair.api`` or ``nvpair.views`` (tests/test_layers.py).
"""
