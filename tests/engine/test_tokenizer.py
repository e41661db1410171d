from moetier.engine.tokenizer import TextStream, Tokenizer
from moetier.store.synth import byte_tokenizer


def test_stream_holds_back_incomplete_utf8(tmp_path):
    byte_tokenizer().save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_file(tmp_path / "tokenizer.json")
    ids = tok.encode("a é b")  # é is two bytes, two tokens
    assert tok.decode(ids) == "a é b"
    stream = TextStream(tok)
    deltas = [stream.delta(ids[:n]) for n in range(1, len(ids) + 1)]
    assert "".join(deltas) == "a é b"
    assert "\ufffd" not in "".join(deltas)
    assert deltas[2] == ""  # the first byte of é alone is held back
