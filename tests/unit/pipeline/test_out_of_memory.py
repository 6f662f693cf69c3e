"""A device out of memory becomes one line naming where and the batch's shape, for CUDA's
`torch.OutOfMemoryError` and for the host allocator's failure (a plain RuntimeError)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.devices import is_out_of_memory
from dflash_train.pipeline.workers import DeviceOutOfMemory, out_of_memory_named


def host_allocation_failure() -> RuntimeError:
    """What torch raises for a host allocation that cannot be made."""
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("an allocation of 2**62 bytes succeeded")


def test_the_host_allocators_failure_is_an_out_of_memory():
    e = host_allocation_failure()
    assert not isinstance(e, torch.OutOfMemoryError)  # why the message is matched
    assert is_out_of_memory(e)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))


@pytest.mark.parametrize("error", [host_allocation_failure, lambda: torch.OutOfMemoryError("x")])
def test_an_out_of_memory_is_named_with_the_batchs_shape(error):
    """Regression: a CPU run whose batch could not be allocated (e.g. `--block-size 100000`)
    ended in a traceback, not the out-of-memory line with what to lower."""
    shape = "batch of 8 x 384 tokens"
    named = out_of_memory_named(torch.device("cpu"), "drafter step", lambda: shape)
    with pytest.raises(DeviceOutOfMemory) as raised, named:
        raise error()
    assert str(raised.value) == "out of memory on cpu in the drafter step (batch of 8 x 384 tokens)"


def test_other_errors_pass_unchanged():
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="shape"), out_of_memory_named(cpu, "step", lambda: "b"):
        raise RuntimeError("shape mismatch")
