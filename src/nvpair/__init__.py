"""nvpair: an engine manager for LLM inference engines whose reads never wait on an engine."""

__version__ = "0.1.0"
