"""Prefill/decode disaggregation: the worker-side connector half, the transport, the engine and server glue,
and the proxy (docs/disaggregation.md). The scheduler-side half is recap.core.transfer."""
