"""`recap serve --quantization int8` (or int4, int4_k) reaches the engine config; other values are usage errors."""

from __future__ import annotations

import pytest

from recap import cli
from recap.launch.engine_args import engine_config


def test_quantization_flag() -> None:
    parser = cli.build_parser()
    assert engine_config(parser.parse_args(["serve", "m", "--quantization", "int8"])).quantization == "int8"
    assert engine_config(parser.parse_args(["serve", "m", "-q", "int8", "--dtype", "bfloat16"])).quantization == "int8"
    assert engine_config(parser.parse_args(["serve", "m", "-q", "int4"])).quantization == "int4"
    assert engine_config(parser.parse_args(["serve", "m", "-q", "int4_k"])).quantization == "int4_k"  # super-blocks
    assert engine_config(parser.parse_args(["serve", "m"])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "m", "--quantization", "fp4"])
