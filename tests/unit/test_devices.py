"""Dtype names and device lists: one table, one parser, clear errors."""

from __future__ import annotations

import pytest
import torch

from dflash_train.devices import DTYPES, parse_devices, parse_dtype, resolve_dtype

CPU = torch.device("cpu")


def test_dtype_names_map_to_torch_dtypes_and_auto_follows_the_device():
    assert {name: parse_dtype(name) for name in DTYPES} == DTYPES
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("float16", CPU) == torch.float16


def test_an_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"one of \['bfloat16', 'float16', 'float32'\]"):
        parse_dtype("fp8")
    with pytest.raises(ValueError, match="auto or one of"):
        resolve_dtype("auto-ish", CPU)


def test_device_lists_are_parsed_and_checked():
    assert parse_devices("cpu, cpu", "--devices") == [CPU, CPU]
    with pytest.raises(ValueError, match="--devices: at least one device"):
        parse_devices(" , ", "--devices")
    with pytest.raises(ValueError, match="not a device name"):
        parse_devices("gpu0", "--devices")
    with pytest.raises(ValueError, match="only cpu and cuda"):
        parse_devices("meta", "--devices")
