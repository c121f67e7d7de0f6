import json

import numpy as np
import pytest
import torch

from engram import ConfigError, EngramConfig, HashInputError, NgramHashMapping, get_hash_mapping
from engram.hashing import kernels as hash_kernels

KERNELS = ["torch"] + (["numba"] if hash_kernels.available() else [])
INT64 = 1 << 64


# ---------------------------------------------------------------- independent slow implementation
def _is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def slow_hash(ids, lookup, layer_ids, vocab_sizes, N, K, pad_id, seed):
    """The formula of PAPER_NOTES, in plain Python integers (wrapping emulated explicitly)."""
    comp_vocab = max(lookup) + 1
    half = max(1, ((2**63 - 1) // comp_vocab) // 2)
    taken, primes = set(), {}
    for layer in layer_ids:
        primes[layer] = []
        for n in range(2, N + 1):
            start = vocab_sizes[n - 2] - 1
            for _ in range(K):
                c = start + 1
                while c in taken or not _is_prime(c):
                    c += 1
                taken.add(c)
                primes[layer].append(c)
                start = c
    pad = lookup[pad_id]
    out = {}
    for layer in layer_ids:
        rng = np.random.default_rng(seed + 10007 * layer)
        mult = [2 * int(v) + 1 for v in rng.integers(0, half, size=N, dtype=np.int64)]
        rows = []
        for seq in ids:
            x = [lookup[t] for t in seq]
            seq_rows = []
            for t in range(len(x)):
                cols = []
                for n in range(2, N + 1):
                    mix = 0
                    for k in range(n):
                        tok = x[t - k] if t - k >= 0 else pad
                        mix ^= (tok * mult[k]) % INT64  # unsigned 64-bit view of the wrapped product
                    signed = mix - INT64 if mix >= 1 << 63 else mix
                    cols += [signed % p for p in primes[layer][(n - 2) * K:(n - 1) * K]]  # floor modulo
                seq_rows.append(cols)
            rows.append(seq_rows)
        out[layer] = rows
    return out


@pytest.fixture(scope="module")
def default_mapping():
    return get_hash_mapping(EngramConfig())


@pytest.mark.parametrize("kernel", KERNELS)
def test_golden_hash_default(golden_dir, default_mapping, kernel, monkeypatch):
    g = json.loads((golden_dir / "hash_default.json").read_text())
    m = default_mapping
    monkeypatch.setattr(m, "kernel", kernel)  # the mapping is get_hash_mapping's shared one: restored after the test
    assert m.raw_vocab_size == g["tokenizer_len"] and m.tokenizer_vocab_size == g["compressed_vocab_size"]
    for lid in m.layer_ids:
        assert m.vocab_size_across_layers[lid] == g["head_moduli"][str(lid)]
        assert [int(v) for v in m.layer_multipliers[lid]] == g["layer_multipliers"][str(lid)]
    assert len(g["cases"]) >= 7
    for case in g["cases"]:
        B = len(case["input_ids"])
        ids = np.array(case["input_ids"], dtype=np.int64).reshape(B, -1)
        assert np.array_equal(m.compressed_tokenizer(ids), np.array(case["compressed_ids"]).reshape(ids.shape))
        got_np = m.hash(ids)
        got_t = m.hash(torch.from_numpy(ids))
        for lid in m.layer_ids:
            want = np.array(case["hash_ids"][str(lid)], dtype=np.int64).reshape(B, ids.shape[1], 16)
            assert isinstance(got_np[lid], np.ndarray) and np.array_equal(got_np[lid], want), case["text"]
            assert isinstance(got_t[lid], torch.Tensor) and got_t[lid].dtype == torch.int64
            assert np.array_equal(got_t[lid].numpy(), want)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    "N, K, sizes, layers",
    [(2, 1, [7], [0]), (3, 2, [50, 61], [0, 3]), (4, 3, [101, 97, 500], [2, 1]), (3, 4, [3_000_000, 2_100_000], [5]),
     # the fused kernel's exact range ends at 2^36 (the torch path's at 2^26, then int64 remainder)
     (3, 2, [30_000_000, 1 << 30], [1]), (2, 3, [(1 << 36) - 1000], [4])],
)
def test_matches_slow_python_formula(default_mapping, kernel, N, K, sizes, layers):
    ct = default_mapping.compressed_tokenizer
    m = NgramHashMapping(sizes, N, 8 * K, K, layers, None, 2, 7, compressed_tokenizer=ct, kernel=kernel)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, ct.vocab_size, size=(2, 9))
    ids[0, :2] = 2  # pad ids inside the text
    ids[1, -1] = ct.vocab_size - 1
    want = slow_hash(ids.tolist(), ct.lookup_table.tolist(), layers, sizes, N, K, 2, 7)
    got, rows = m.hash(ids), m.hash(ids, offsets=True)
    for lid in layers:
        assert got[lid].shape == (2, 9, (N - 1) * K)
        assert got[lid].tolist() == want[lid]
        assert np.array_equal(rows[lid], got[lid] + np.array(m.head_offsets(lid)))  # the tables' global rows


def test_kernels_agree_on_large_batch(default_mapping):
    if "numba" not in KERNELS:
        pytest.skip("numba not installed")
    ids = np.random.default_rng(0).integers(0, default_mapping.raw_vocab_size, size=(4, 1000))
    m = default_mapping
    try:
        m.kernel = "numba"
        a = m.hash(ids)
        m.kernel = "torch"
        b = m.hash(ids)
    finally:
        m.kernel = "auto"
    for lid in m.layer_ids:
        assert np.array_equal(a[lid], b[lid])


def test_empty_sequence(default_mapping):
    out = default_mapping.hash(np.zeros((2, 0), dtype=np.int64))
    assert all(v.shape == (2, 0, 16) for v in out.values())


@pytest.mark.parametrize(
    "bad, match",
    [
        (np.array([[1, 2, 128815]]), r"token id 128815 at position \(0, 2\) is outside \[0, 128815\)"),
        (np.array([[1, -3, 4]]), r"token id -3 at position \(0, 1\).*negative"),
        (np.array([[1.0, 2.0]]), "integer token ids, got dtype float64"),
        (torch.tensor([[1.0]]), "integer token ids, got dtype torch.float32"),
        (np.array([1, 2, 3]), r"2-D \[batch, seq_len\], got 1-D"),
        (torch.ones(1, 2, 3, dtype=torch.long), "got 3-D"),
        ([[1, 2]], "numpy array or torch tensor"),
    ],
)
def test_bad_input_errors(default_mapping, bad, match):
    with pytest.raises(HashInputError, match=match):
        default_mapping.hash(bad)


def test_spec_round_trip_and_tokenizer_mismatch(tmp_path, default_mapping):
    p = tmp_path / "spec.json"
    default_mapping.save_spec(p)
    spec = json.loads(p.read_text())
    assert spec["layers"]["1"]["head_offsets"] == default_mapping.head_offsets(1)
    assert spec["compressed_pad_id"] == default_mapping.compressed_pad_id == default_mapping.pad_id
    import base64
    table = np.frombuffer(base64.b64decode(spec["lookup_table_int32_le_b64"]), dtype="<i4")
    assert np.array_equal(table, default_mapping.compressed_tokenizer.lookup_table)
    m2 = NgramHashMapping.from_spec(p)
    ids = np.random.default_rng(3).integers(0, m2.raw_vocab_size, size=(2, 20))
    a, b = m2.hash(ids), default_mapping.hash(ids)
    assert all(np.array_equal(a[l], b[l]) for l in a)
    spec["tokenizer_sha256"] = "0" * 64
    p.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="tokenizer mismatch"):
        NgramHashMapping.from_spec(p)
    with pytest.raises(ConfigError, match="not found"):
        NgramHashMapping.from_spec(tmp_path / "missing.json")


@pytest.mark.parametrize("mode", ["shuffled", "constant"])
def test_offsets_follow_the_ablation_modes(default_mapping, mode):
    ct = default_mapping.compressed_tokenizer
    m = NgramHashMapping([50, 61], 3, 16, 2, [0, 3], None, 2, 7, compressed_tokenizer=ct, hash_mode=mode)
    ids = np.random.default_rng(2).integers(0, ct.vocab_size, size=(2, 9))
    got, rows = m.hash(ids), m.hash(ids, offsets=True)
    for lid in m.layer_ids:
        assert np.array_equal(rows[lid], got[lid] + np.array(m.head_offsets(lid)))


# ---------------------------------------------------------------- hash identity: hash_mode is part of it
def test_hash_mode_is_part_of_the_hash_identity(default_mapping):
    """A manifest saved under "shuffled" or "constant" must not pass an "ngram" model's check (nor the reverse):
    the modes address other rows with the same constants. A manifest without the key means "ngram"."""
    from engram.hashing import spec_identity

    ct = default_mapping.compressed_tokenizer
    modes = {mode: NgramHashMapping([50, 61], 3, 16, 2, [0, 3], None, 2, 7, compressed_tokenizer=ct, hash_mode=mode)
             for mode in ("ngram", "shuffled", "constant")}
    for mine, m in modes.items():
        for saved, other in modes.items():
            if mine == saved:
                m.check_spec(other.spec(include_lookup_table=False))
            else:
                with pytest.raises(ConfigError, match=f"saved under hash_mode '{saved}'"):
                    m.check_spec(other.spec(include_lookup_table=False))
    old = {k: v for k, v in modes["shuffled"].spec(include_lookup_table=False).items() if k != "hash_mode"}
    assert spec_identity(old)["hash_mode"] == "ngram"
    modes["ngram"].check_spec(old)
    with pytest.raises(ConfigError, match="saved under hash_mode 'ngram'"):
        modes["shuffled"].check_spec(old)


def test_identity_digests_old_and_new(default_mapping):
    """Overlays record a digest. An "ngram" digest is the one engram always wrote (old overlays keep loading);
    another mode's differs; a digest from before hash_mode counted is refused on a non-"ngram" model."""
    import hashlib

    from engram.hashing import check_digest, identity_digest, legacy_identity_digest

    ct = default_mapping.compressed_tokenizer
    spec = {mode: NgramHashMapping([50, 61], 3, 16, 2, [0, 3], None, 2, 7, compressed_tokenizer=ct,
                                   hash_mode=mode).spec(include_lookup_table=False) for mode in ("ngram", "shuffled")}
    old_keys = ("family", "lookup_table_sha256", "compressed_pad_id", "layers")  # the identity before hash_mode
    old = {m: hashlib.sha256(json.dumps({k: s.get(k) for k in old_keys}, sort_keys=True).encode()).hexdigest()
           for m, s in spec.items()}
    assert old["ngram"] == old["shuffled"]  # the bug: the old digest cannot tell the modes apart
    assert identity_digest(spec["ngram"]) == old["ngram"] != identity_digest(spec["shuffled"])
    for m in spec:
        check_digest(spec[m], identity_digest(spec[m]), "ov", "fix")
    check_digest(spec["ngram"], old["ngram"], "ov", "fix")
    check_digest(spec["ngram"], legacy_identity_digest(spec["ngram"]), "ov", "fix")
    with pytest.raises(ConfigError, match="another hash manifest.*; re-edit"):
        check_digest(spec["ngram"], identity_digest(spec["shuffled"]), "ov", "re-edit")
    with pytest.raises(ConfigError, match="another hash manifest"):
        check_digest(spec["shuffled"], identity_digest(spec["ngram"]) + "0", "ov", "re-edit")
    for digest in (old["shuffled"], legacy_identity_digest(spec["shuffled"])):
        with pytest.raises(ConfigError, match="cannot be proven to match this model's hash_mode 'shuffled'; re-edit"):
            check_digest(spec["shuffled"], digest, "ov", "re-edit")


@pytest.mark.parametrize("kernel", KERNELS)
def test_dead_positions_and_resets_are_one_mechanism(default_mapping, kernel):
    """Any family takes a DEAD mask: a DEAD position reads the pad, and n-grams after it stop there, as at a
    sequence start; hashing around a DEAD position equals hashing the pieces as separate sequences."""
    m = get_hash_mapping(EngramConfig())
    ids = np.random.default_rng(5).integers(0, m.raw_vocab_size, size=(2, 12))
    dead = np.zeros((2, 12), dtype=bool)
    dead[0, 4] = dead[1, 0] = dead[1, 11] = True
    m.kernel = kernel
    try:
        got = m.hash(ids, dead=dead)
        pad_rows = m.hash(np.full((1, 1), m.raw_pad_id))  # the all-pad n-grams
        for lid in m.layer_ids:
            left, right = m.hash(ids[:1, :4])[lid], m.hash(ids[:1, 5:])[lid]
            assert np.array_equal(got[lid][0, :4], left[0]) and np.array_equal(got[lid][0, 5:], right[0])
            assert np.array_equal(got[lid][0, 4], pad_rows[lid][0, 0])
            assert np.array_equal(got[lid][1, 1:11], m.hash(ids[1:, 1:11])[lid][0])
            cont = m.hash_continuation(torch.from_numpy(ids[:, 6:]), torch.from_numpy(ids[:, 4:6]),
                                       dead=torch.from_numpy(dead[:, 6:]), history_dead=torch.from_numpy(dead[:, 4:6]))
            assert np.array_equal(cont[lid].numpy(), got[lid][:, 6:])
    finally:
        m.kernel = "auto"


def _window_cases():
    """(name, mapping factory) for each kind of family `hash_windows` serves: the reference's (the fused kernel on
    numba, the torch path), one with resets and raw ids (qwen4_exp), one with its own mix and resets (LongCat)."""
    cases = [("deepseek-" + b, lambda b=b: NgramHashMapping.for_family(get_hash_mapping(EngramConfig()).family,
                                                                       kernel=b)) for b in KERNELS]
    from engram.integrations import longcat

    cases.append(("longcat", lambda: longcat.hash_mapping(dict(
        vocab_size=50, ngram_vocab_size_ratio=3, emb_split_num=2, emb_neighbor_num=3, eos_token_id=2, hidden_size=16,
        model_type="longcat_flash_ngram"))))
    try:
        from bases import qwen4_config

        from engram.integrations.qwen4_exp import hash_mapping as qwen4_mapping

        cases.append(("qwen4_exp", lambda: qwen4_mapping(qwen4_config())))
    except ImportError:  # (a transformers without qwen4_exp: that case is skipped)
        pass
    return cases


@pytest.mark.parametrize("name,make", _window_cases(), ids=[c[0] for c in _window_cases()])
def test_hash_windows_equal_hash_at_each_position(name, make):
    """`hash_windows` (a serving step: each token's N-id window, gathered per request, positions before its sequence
    marked by `start`) gives what `hash` gives those tokens inside their whole sequences, with and without offsets,
    resets (EOS) included."""
    m = make()
    N = m.max_ngram_size
    g = np.random.default_rng(7)
    V = min(m.raw_vocab_size, 50)  # small ids: EOS / reset ids recur
    seqs = g.integers(0, V, size=(3, 11))
    for offsets in (False, True):
        whole = m.hash(seqs, offsets=offsets)
        b, t = np.meshgrid(np.arange(3), np.arange(11), indexing="ij")
        b, t = b.ravel(), t.ravel()
        cols = t[:, None] - np.arange(N - 1, -1, -1)  # (M, N) positions, oldest first
        windows = np.where(cols >= 0, seqs[b[:, None], np.maximum(cols, 0)], g.integers(0, V, size=cols.shape))
        got = m.hash_windows(windows, np.maximum(N - 1 - t, 0), offsets=offsets)  # placeholders before the start
        for lid in m.layer_ids:
            assert torch.equal(torch.as_tensor(got[lid]), torch.as_tensor(whole[lid][b, t])), (name, offsets, lid)


def test_hash_windows_bad_input_is_one_line(default_mapping):
    m = default_mapping
    with pytest.raises(HashInputError, match=r"windows must be \(M, 3\)"):
        m.hash_windows(np.zeros((4, 2), dtype=np.int64))
    with pytest.raises(HashInputError, match=r"token id \d+ at position \(0, 0\) is outside"):
        m.hash_windows(np.full((2, 3), m.raw_vocab_size, dtype=np.int64))
