"""One set of stop ids along the chain: where `regenerate` stops the target, where `prepare` ends
an answer's supervision, and where `eval` and in-loop eval stop decoding."""

from __future__ import annotations

from types import SimpleNamespace

from dflash_train.data.chat import ChatFormat
from dflash_train.data.prompts import eos_token_ids


def test_eval_stops_at_the_templates_end_of_turn_and_the_targets_eos(make_tokenizer):
    """Regression: eval stopped on the generation config's and the tokenizer's eos alone; with
    a Llama 3 style tokenizer whose eos is <|end_of_text|> it decoded past <|eot_id|>, the
    token prepare ends each answer with, and counted rounds after the turn in tau."""
    tok = make_tokenizer("llama3", False)
    tok.eos_token = "<|end_of_text|>"  # as Llama 3's base tokenizer names it
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.eos_token_id != eot
    target = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    stops = eos_token_ids(target, tok)
    assert eot in stops and tok.eos_token_id in stops
    assert set(ChatFormat(tok).stop_token_ids) <= set(stops)
    # And a generation config's own eos (a served target stops there) joins them.
    target.generation_config.eos_token_id = [7, eot]
    assert set(eos_token_ids(target, tok)) == {7, eot, tok.eos_token_id}


def test_a_tokenizer_without_a_chat_template_stops_at_the_eos_alone(make_tokenizer):
    tok = make_tokenizer("qwen3", False)
    tok.chat_template = None
    target = SimpleNamespace(generation_config=None)
    assert eos_token_ids(target, tok) == [tok.eos_token_id]


def test_regenerate_stops_the_target_where_eval_and_a_served_target_stop(
    make_tokenizer, monkeypatch
):
    """Regression: regenerate's local back end stopped on the template's end-of-turn and the
    tokenizer's eos only, and ran past an eos the target's generation config names, where
    a serving engine (and eval) stop it."""
    import torch

    from dflash_train.data import generation

    tok = make_tokenizer("qwen3", False)
    extra = tok.convert_tokens_to_ids("<|endoftext|>")
    model = SimpleNamespace(
        get_input_embeddings=lambda: SimpleNamespace(weight=torch.zeros(len(tok), 1)),
        generation_config=SimpleNamespace(eos_token_id=[extra]),
        config=SimpleNamespace(max_position_embeddings=64),
    )
    monkeypatch.setattr(generation, "load_causal_lm", lambda *args, **kwargs: model)
    backend = object.__new__(generation.LocalBackend)
    backend.target, backend.device, backend.dtype, backend.seed = "t", "cpu", None, 0
    backend.fmt = ChatFormat(tok)
    backend._load_model()
    stops = set(backend.stop_ids)
    assert stops == set(eos_token_ids(model, tok))
    assert stops >= {extra, *backend.fmt.stop_token_ids}
