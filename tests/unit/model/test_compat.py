"""The version shims (`model.compat`) on stand-ins for both conventions of each library
version they bridge; the real releases run them in the target zoo's tests (the default suite
at the lowest versions: `scripts/lowest_versions.py`)."""

from __future__ import annotations

import pytest
from torch import nn

from dflash_train.model import compat


class NewCache:
    """transformers >= 5.15: `crop(tokens_to_remove)`, negative removes, 0 trims windows."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, []

    def get_seq_length(self) -> int:
        return self.n

    def crop(self, tokens_to_remove: int) -> None:
        self.calls.append(tokens_to_remove)
        assert tokens_to_remove <= 0, "positive values are refused from 5.18"
        self.n += tokens_to_remove


class OldCache(NewCache):
    """transformers < 5.15: `crop(max_length)`, negative removes, 0 empties the cache."""

    def crop(self, max_length: int) -> None:
        self.calls.append(max_length)
        self.n = self.n + max_length if max_length < 0 else min(self.n, max_length)


@pytest.mark.parametrize("cls", [NewCache, OldCache])
def test_crop_cache_keeps_the_first_positions_in_either_convention(cls):
    cache = cls(10)
    compat.crop_cache(cache, 7)
    assert cache.get_seq_length() == 7
    compat.crop_cache(cache, 7)  # at the current length: nothing lost
    assert cache.get_seq_length() == 7
    if cls is NewCache:
        assert cache.calls == [-3, 0]  # crop(0) still trims recorded windows
    else:
        assert cache.calls == [7]  # crop(0) would have emptied it


class WithCache(nn.Module):
    def forward(self, input_ids, cache=None, use_cache=None, **kwargs): ...


class WithPastKeyValues(nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs): ...


def test_cache_kwargs_names_the_argument_the_forward_declares():
    marker = object()
    assert compat.cache_kwargs(WithCache(), marker) == {"cache": marker}
    assert compat.cache_kwargs(WithPastKeyValues(), marker) == {"past_key_values": marker}

    class Compiled(nn.Module):  # torch.compile's wrapper: forward(*args, **kwargs)
        def __init__(self) -> None:
            super().__init__()
            self._orig_mod = WithCache()

    assert compat.cache_kwargs(Compiled(), marker) == {"cache": marker}


@pytest.mark.parametrize(
    ("text", "want"),
    [("5.17.0", (5, 17, 0)), ("2.11.0+cu130", (2, 11, 0)), ("5.18.0.dev0", (5, 18, 0)),
     ("5.0.0rc1", (5, 0, 0)), ("5.15", (5, 15))],
)  # fmt: skip
def test_version_tuple_reads_release_numbers(text, want):
    assert compat.version_tuple(text) == want


def test_require_family_names_the_release_a_family_needs(monkeypatch):
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.10.4")
    with pytest.raises(
        ValueError, match=r"'gemma3' target needs transformers>=5\.15\.0 \(installed: 5\.10\.4\)"
    ):
        compat.require_family("gemma3")
    compat.require_family("llama")  # no bound of its own
    monkeypatch.setattr(compat, "transformers_version", lambda: "5.15.0")
    compat.require_family("gemma3")
