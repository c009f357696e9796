"""Names every side of the wire agrees on: the OpenAI app serves them, the P/D proxy and the Ray ingresses
route by them."""

from __future__ import annotations

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")  # what generates (admission counts these)
# OpenAI's Responses API: it generates (admission counts it), but its stored responses live in the process that
# answered, so the P/D proxy does not serve it and the Ray ingress pins a call naming one (recap.http.response_ids)
RESPONSES_ROUTE = "/v1/responses"
KV_TRANSFER_PARAMS = "kv_transfer_params"  # vLLM's request and response field for prefill/decode handles
KV_API_KEY_HEADER = "x-kv-api-key"  # the front end's credential for `do_remote_decode` (recap.disagg.api)
