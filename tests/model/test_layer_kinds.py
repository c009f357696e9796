"""The layer-kind table, the mixer configs' protocol, the mixer call contract, and recap.model's import graph."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import recap.model
from recap.model.config import AttentionConfig, MLAConfig, ModelConfig
from recap.model.layer_kinds import LAYER_KINDS, LAYER_TYPES, build_mixer, mixer_class
from recap.model.layers.mixer import Mixer
from recap.model.mixer_configs import MixerConfig
from recap.model.testing import tiny_hf_config
from tests.model.test_state_slot import mixed_config

MODEL_DIR = Path(recap.model.__file__).parent


def _configs_by_kind() -> dict[str, tuple[ModelConfig, int]]:
    """Layer kind -> (the first tiny family config with such a layer, that layer)."""
    from recap.model.families import FAMILIES
    from recap.model.hf_config import translate_config

    found: dict[str, tuple[ModelConfig, int]] = {}
    for f in FAMILIES:
        hf = tiny_hf_config(f.tiny.name).to_dict()
        hf["architectures"] = [f.architecture]
        cfg = translate_config(hf)
        for i, kind in enumerate(cfg.layer_types):
            found.setdefault(kind, (cfg, i))
    return found


def test_the_table_covers_every_kind_and_answers_the_caches() -> None:
    by_kind = _configs_by_kind()
    assert set(by_kind) == set(LAYER_TYPES)  # every kind is run by some family
    for name, (cfg, layer) in by_kind.items():
        kind = LAYER_KINDS[name]
        assert (layer in cfg.attention_layers) == kind.holds_kv
        assert (layer in cfg.ssm_layers) == kind.holds_state
        configs = cfg.mixer_configs(layer)
        assert all(isinstance(c, MixerConfig) for c in configs)
        assert len(configs) == kind.holds_kv + kind.holds_state
        if kind.holds_kv:  # an attention config declares state only in a layer holding some (Inkling's K/V convs)
            assert cfg.kv_specs(layer) and (kind.holds_state or not configs[0].state_specs())
        else:
            with pytest.raises(ValueError, match="has no attention"):
                cfg.kv_specs(layer)
        if kind.holds_state:
            own = tuple(spec for c in configs for spec in c.state_specs())
            assert cfg.state_specs(layer) == own and configs[-1].state_specs() and not configs[-1].kv_specs()
        else:
            with pytest.raises(ValueError, match="has no recurrent state"):
                cfg.state_specs(layer)


def test_build_mixer_follows_the_table() -> None:
    """A single-mixer kind builds its config's layer class, which reads the cache group its kind holds; "hybrid"
    and "none" have no single mixer."""
    for name, (cfg, layer) in _configs_by_kind().items():
        kind = LAYER_KINDS[name]
        if kind.holds_kv + kind.holds_state != 1:
            with pytest.raises(ValueError, match="has no single mixer"):
                build_mixer(cfg, layer, torch.float32)
            continue
        mixer = build_mixer(cfg, layer, torch.float32)
        assert type(mixer) is mixer_class(cfg.mixer_configs(layer)[0]) and isinstance(mixer, Mixer)
        group = ("window" if cfg.window_of(layer) else "kv") if kind.holds_kv else "state"
        assert mixer.cache_group == group


def _all_subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_all_subclasses(sub))]


def test_every_mixer_config_names_a_mixer() -> None:
    subclasses = _all_subclasses(MixerConfig)  # however deep: a family's config may refine another's
    assert {AttentionConfig, MLAConfig} <= set(subclasses)
    for cfg_cls in subclasses:
        assert issubclass(mixer_class(cfg_cls), Mixer)  # type: ignore[arg-type]  # reads the ClassVar only


def test_a_kind_without_its_config_or_unknown_is_refused() -> None:
    base = mixed_config()
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    for kind, missing in (("gdn", "gdn"), ("mamba1", "mamba1"), ("attention", "attention"), ("hybrid", "mamba2")):
        with pytest.raises(ValueError, match=f"layer type '{kind}' used without its config"):
            ModelConfig(**{**fields, "layer_types": (kind,), "mlp_types": ("none",), missing: None})
    with pytest.raises(ValueError, match="unknown layer type 'retention'"):
        ModelConfig(**{**fields, "layer_types": ("retention",), "mlp_types": ("none",)})


def _module_imports(path: Path) -> set[str]:
    """The recap modules `path` imports when it is imported (top level, TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else ():
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.startswith("recap."):
                found.add(sub.module)
                found.update(f"{sub.module}.{a.name}" for a in sub.names)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("recap."))
    return found


def test_recap_model_imports_no_module_in_a_circle() -> None:
    """Module-level imports between recap.model's modules form no cycle (package __init__ files left out: they
    only gather). config <-> hf_config <-> translators was one."""
    modules = {
        ".".join(("recap", *p.relative_to(MODEL_DIR.parent).with_suffix("").parts)): p
        for p in MODEL_DIR.rglob("*.py")
        if p.name != "__init__.py"
    }
    graph = {m: sorted(_module_imports(p) & modules.keys()) for m, p in modules.items()}
    assert graph["recap.model.hf_config"]  # the imports are seen
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*path[path.index(n):], n])}")
            if n not in state:
                visit(n, [*path, n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
