"""Launching recap's servers from flags: `recap serve` (one process, or replicas on Ray Serve) and the
wiring that puts the OpenAI app (recap.server) over a prefill/decode engine (recap.disagg) or into Ray
replicas (recap.cluster). The only package that imports server, disagg and cluster together.

Package order, one way (tests/test_package_edges.py checks it):
    recap.http      the HTTP toolkit: imports none of the packages below
    recap.server    the OpenAI app: imports recap.http
    recap.disagg    prefill/decode (transport, engine, proxy, the P/D flow): imports recap.http
    recap.cluster   Ray Serve (replicas, router, ingresses): imports recap.http and recap.disagg
    recap.launch    imports all of them; recap.cli imports recap.launch
"""
