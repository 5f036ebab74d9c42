"""Speculative decoding in the worker (docs/ARCHITECTURE.md §5.5): proposers (`base.Proposer`
and one module per method), verification (`verify`) and the worker's token history
(`history`, for proposers that read the context)."""
