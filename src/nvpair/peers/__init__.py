"""The peers broker: every node keeps the cluster's models in memory, fed by a background

The modules:

* ``advert``: what a node says about itself (`Advert`), and the `Advertiser` that keeps it
  current.
* ``table``: the peer table: each peer's newest advert, its state computed when read.
* ``feed``: the peer table as the event journal reads it (each peer's state and models).
* ``receiver``: `POST /v1/peers/adverts`, where pushed adverts arrive.
* ``status``: `GET /v1/peers`.
* ``push``: one `Pusher` per configured peer, over one kept-alive connection.
* ``gateway``: the few calls of etcd's v3 JSON gateway the etcd backend needs.
* ``etcd``: the etcd backend: this node's advert under a leased key, every node's from a
  watch.
* ``broker``: builds and runs the node's peers for the service.
* ``groups``: `Groups`, the groups wired to the peers (`GroupLink`: what each node last said
  about a group).
* ``epochkey``: `EpochKey`, with etcd: the head claims each epoch under one key tied to its
  lease (a compare-and-swap), and `EpochWatch`, its ranks' watch of that key, so two heads
  never both run one and a rank fences itself once its head's lease is gone.
"""
