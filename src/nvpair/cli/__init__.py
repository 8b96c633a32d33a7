"""The ``nvpair`` command line."""
