"""Small helpers with nothing of nvpair above them: ages, decoding, streams, URLs.

The modules:

* ``decoding``: strict JSON decoding with limits; msgspec's errors as one line naming the
  file and path.
* ``ages``: seconds since a monotonic timestamp, computed at read time.
* ``urls``: whether a URL from the config or an advert is one nvpair's clients can open.
* ``tls``: the one shared TLS context for every HTTP client (building one costs ~55 ms).
* ``streams``: closing httpx2's and httpcore2's body iterators early without leaks.
* ``boundary``: fault boundaries: `Part` (`failed`, `ok`, `guard`, `supervise`), `Backoff`,
  `failure_line`.
* ``logs``: a managed engine's output: a bounded ring of lines and a size-capped file,
* ``changes``: `Changes`, a version that moves with each change (`bump`, `wait_changed`).
* ``histogram``: `Histogram`, fixed buckets of durations the router and the sweep observe
  for `/metrics`.
* ``logformat``: nvpair's own log lines as text or JSON, with the request and engine a line
  is about (`about`).
* ``logsetup``: where nvpair's log and the access log go (`install`); a reload switches
  them (`switch_format`, `switch_access`).
* ``otlp``: finished spans (`Span`) and the OTLP protobuf they are exported as, written by
  hand (`encode_span`, `encode_request`).
* ``words``: counts and durations in words (``3 requests``, ``4.2 s``) for lines people
  read.
* ``traceparent``: W3C Trace Context's ``traceparent`` header, read strictly (`parse`) and
  written (`header`).
"""
