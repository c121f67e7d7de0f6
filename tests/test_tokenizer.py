import json
import os

import numpy as np
import pytest

from engram import CompressedTokenizer, TokenizerError
from engram.tokenizer import resolve_tokenizer_file


@pytest.fixture(scope="module")
def ct():
    return CompressedTokenizer()


def test_lookup_table_equals_golden(ct, golden_dir):
    golden = np.load(golden_dir / "deepseek_v3_lookup_table.npy")
    assert ct.vocab_size == 128815 == len(golden)
    assert np.array_equal(ct.lookup_table, golden)
    assert ct.num_new_token == 98627


def test_len_is_the_compressed_vocabulary_as_in_the_reference(ct, golden_dir):
    """The reference's `__len__` returns the compressed size: multipliers derived from `len()` are the golden ones."""
    from engram.hashing import layer_multipliers

    assert len(ct) == 98627 == ct.num_new_token
    golden = json.loads((golden_dir / "hash_default.json").read_text())["layer_multipliers"]
    derived = layer_multipliers([1, 15], 3, len(ct), 0)
    assert {str(k): [int(x) for x in v] for k, v in derived.items()} == golden


def test_call_keeps_shape_and_passes_negatives(ct):
    ids = np.array([[0, 1, 2], [-1, 128814, 5]])
    out = ct(ids)
    assert out.shape == ids.shape and out.dtype == np.int64
    assert out[1, 0] == -1 and out[1, 1] == ct.lookup_table[128814]


def test_folder_and_name_resolve_to_same_file(ct):
    folder = resolve_tokenizer_file(None).parent
    assert resolve_tokenizer_file(folder) == resolve_tokenizer_file("deepseek-ai/DeepSeek-V3")


def test_missing_tokenizer_is_clear(tmp_path):
    with pytest.raises(TokenizerError, match="neither a tokenizer.json"):
        CompressedTokenizer(tmp_path / "nope")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{broken")
    with pytest.raises(TokenizerError, match="could not load"):
        CompressedTokenizer(bad)


def _tiny_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "a": 1, "A": 2, "á": 3, "b": 4, " ": 5, "  ": 6, "\t": 7}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[PAD]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def test_other_tokenizer_merges_case_accents_and_spaces(tmp_path):
    p = tmp_path / "tokenizer.json"
    _tiny_tokenizer(p)
    ct = CompressedTokenizer(p)
    t = ct.lookup_table
    assert t[1] == t[2] == t[3]  # a, A, á share an id
    assert t[4] != t[1]
    assert t[5] == t[6] == t[7]  # all whitespace runs -> one " " key
    assert list(np.unique(t)) == list(range(ct.num_new_token))  # ids assigned densely in order


def test_cache_is_used_and_corrupt_cache_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "tokenizer.json"
    _tiny_tokenizer(p)
    first = CompressedTokenizer(p).lookup_table
    files = list((tmp_path / "cache").glob("lookup-*.npz"))
    assert len(files) == 1
    files[0].write_bytes(files[0].read_bytes()[:50])  # truncate
    again = CompressedTokenizer(p).lookup_table
    assert np.array_equal(first, again)
    # tampered content with a stale digest is not trusted either
    import io
    with np.load(files[0]) as z:
        table, digest, version = z["table"].copy(), z["digest"], z["version"]
    table[0] = 99
    buf = io.BytesIO()
    np.savez(buf, table=table, digest=digest, version=version)
    files[0].write_bytes(buf.getvalue())
    assert np.array_equal(CompressedTokenizer(p).lookup_table, first)
    assert not [f for f in os.listdir(tmp_path / "cache") if f.endswith(".tmp")]
