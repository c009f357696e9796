"""Engine: LLM (offline), AsyncEngine, request outputs, metrics."""
