"""One translator per HF architecture, from its config.json dict to a `ModelConfig`, grouped by family.

Each is registered with its family in `recap/model/families.py` (which `recap.model.hf_config` reads).
"""
