"""OpenAI-compatible HTTP server: `recap serve` (see recap.server.app.build_app)."""
