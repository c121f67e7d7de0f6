"""qwen4_exp (Qwen3.8-Flash-Next) hashing: bit-exact with the installed transformers' own code."""

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
mq = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

# (the tiny configs, models and ids live in tests/bases.py; test_gguf, test_nvfp4 and test_edit_released use them too)
from bases import ids_with_eos, tiny_base  # noqa: E402
from bases import qwen4_config as config  # noqa: E402
from bases import tiny_qwen4 as tiny_model  # noqa: E402

from engram.config import ConfigError  # noqa: E402
from engram.hashing import NgramHashMapping  # noqa: E402
from engram.integrations.qwen4_exp import Qwen4ExpFamily, hash_mapping, transformers_hashing  # noqa: E402


def transformers_rows(cfg, ple_index, ids, cache=None):
    """Row ids (B, T, H), offsets included, as transformers' Qwen4ExpTextNGramEmbedding computes them."""
    m = transformers_hashing(cfg, ple_index)
    return m(ids, cache), m


@pytest.mark.parametrize("kernel", ["numba", "torch"])
@pytest.mark.parametrize("kw", [{}, {"ngram_size": 4, "heads_per_ngram": 3, "ple_embed_dim": 36, "seed": 99},
                                {"ngram_vocab_size_base": 5003}])
def test_hash_matches_transformers(kw, kernel):
    if kernel == "numba":
        pytest.importorskip("numba")
    cfg = config(**kw)
    mapping = hash_mapping(cfg, kernel=kernel)
    assert mapping.layer_ids == [1, 3] and mapping.family.name == "qwen4_exp"
    for seed in range(3):
        ids = ids_with_eos(cfg, 3, 40, seed)
        got, rows = mapping.hash(ids), mapping.hash(ids, offsets=True)
        for i, lid in enumerate(cfg.ple_layer_ids):
            want, ref = transformers_rows(cfg, i, ids)
            assert mapping.head_sizes(lid) == ref.head_vocab_sizes
            offsets = torch.tensor(mapping.head_offsets(lid))
            assert torch.equal(got[lid] + offsets, want)
            assert torch.equal(rows[lid], want)  # offsets added in the kernel (numba) or after it (torch)


def test_continuation_matches_the_cached_transformers_forward():
    """Decoding: the last N-1 ids as history give what transformers computes from its cache's id slot."""
    cfg = config()
    mapping = hash_mapping(cfg)
    ids = ids_with_eos(cfg, 2, 20, 1, eos_every=4)
    full = mapping.hash(ids)
    for t in (1, 5, 13):
        got = mapping.hash_continuation(ids[:, t:t + 1], ids[:, max(0, t - 2):t])
        assert all(torch.equal(got[l], full[l][:, t:t + 1]) for l in mapping.layer_ids)


def test_kernel_serves_the_released_prime_range():
    """The released base (20,000,000: primes ~2^24.3) on the fused kernel equals the torch path and transformers."""
    pytest.importorskip("numba")
    cfg = config(vocab_size=248320, eos_token_id=248044, heads_per_ngram=8, ple_embed_dim=32)
    ids = ids_with_eos(cfg, 2, 64, 0)
    fast, slow = hash_mapping(cfg, "numba").hash(ids), hash_mapping(cfg, "torch").hash(ids)
    want, _ = transformers_rows(cfg, 1, ids)
    lid = cfg.ple_layer_ids[1]
    assert torch.equal(fast[lid], slow[lid])
    assert torch.equal(fast[lid] + torch.tensor(hash_mapping(cfg).head_offsets(lid)), want)
    assert torch.equal(hash_mapping(cfg, "numba").hash(ids, offsets=True)[lid], want)
    # decode-sized calls take the serial kernel: same rows
    step = hash_mapping(cfg, "numba").hash_continuation(ids[:, 9:10], ids[:, 7:9], offsets=True)[lid]
    assert torch.equal(step, want[:, 9:10])


def test_bad_configs_are_one_line():
    with pytest.raises(ConfigError, match="no n-gram table"):
        hash_mapping(config(ple_layer_ids=[]))
    with pytest.raises(ConfigError, match="EOS id"):
        Qwen4ExpFamily(1000, 3, 2, [1], 5003, 0, eos_token_id=5000)
    with pytest.raises(ConfigError, match="not a qwen4_exp config"):
        from transformers import LlamaConfig

        hash_mapping(LlamaConfig())
    assert np.asarray(hash_mapping(config()).hash(np.zeros((1, 3), dtype=np.int64))[1]).shape == (1, 3, 4)


def test_manifest_records_the_family_and_refuses_another(tmp_path):
    m = hash_mapping(config())
    m.save_spec(tmp_path / "spec.json")
    again = NgramHashMapping.from_spec(tmp_path / "spec.json")
    ids = ids_with_eos(config(), 2, 16, 3)
    assert again.family.name == "qwen4_exp" and all(torch.equal(again.hash(ids)[l], m.hash(ids)[l])
                                                    for l in m.layer_ids)
    other = hash_mapping(config(seed=5)).spec()
    with pytest.raises(ConfigError, match="mismatch on 'layers'"):
        m.check_spec(other)
    with pytest.raises(ConfigError, match="family 'deepseek', this model hashes with 'qwen4_exp'"):
        m.check_spec({**other, "family": "deepseek"})


# ------------------------------------------------------------------------------------------ serving the tables
@pytest.mark.parametrize("backend,prefetch", [("ram", False), ("ram", True), ("mmap", True), ("disk", True)])
def test_served_tables_give_transformers_logits_and_generate(backend, prefetch, tmp_path):
    from engram.integrations.qwen4_exp import ServedNGramEmbedding, serve_tables

    ids = ids_with_eos(config(), 2, 14, 1, eos_every=5)
    ref = tiny_model()
    with torch.no_grad():
        want = ref(ids).logits
    want_gen = ref.generate(ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
    m = serve_tables(tiny_model(), backend=backend, dir=tmp_path, prefetch=prefetch)
    assert isinstance(m.model.layers[0].ple.ple_embedding, ServedNGramEmbedding)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert torch.equal(m.generate(ids[:, :6], max_new_tokens=6, do_sample=False, pad_token_id=0), want_gen)
    m.save_pretrained(tmp_path / "saved")  # plain transformers loads what a served model saves
    again = mq.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)


def test_serving_bad_input_is_one_line(tmp_path):
    from engram.integrations.qwen4_exp import serve_tables

    with pytest.raises(ConfigError, match="needs dir="):
        serve_tables(tiny_model(), tier="mmap")
    m = serve_tables(tiny_model(), prefetch=False)
    with pytest.raises(ConfigError, match="already served"):
        serve_tables(m)
    with pytest.raises(ConfigError, match="not a qwen4_exp config"):
        serve_tables(tiny_base("llama"))


def test_table_files_stream_from_checkpoint_shards_and_bad_shards_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    from engram.integrations.qwen4_exp import serve_tables

    ids = ids_with_eos(config(), 2, 12, 2)
    ref = tiny_model()
    ref.save_pretrained(tmp_path / "ckpt")  # the n-gram tables go out as split_ngram_parts=4 row shards
    with torch.no_grad():
        want = ref(ids).logits
        other = tiny_model(seed=3)  # a model whose own table rows are different: the rows must come from the shards
        other.load_state_dict({k: v for k, v in ref.state_dict().items() if "ngram_embedding" not in k}, strict=False)
        assert not torch.equal(other(ids).logits, want)
    m = serve_tables(other, tier="mmap", dir=tmp_path / "t", checkpoint=tmp_path / "ckpt")
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    f = tmp_path / "ckpt" / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.0.ple.ple_embedding.ngram_embedding.shard_3.weight"]  # an incomplete download
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="shards hold .* rows in 3 shards; the config needs .* split_ngram_parts=4"):
        serve_tables(tiny_model(), tier="mmap", dir=tmp_path / "t2", checkpoint=tmp_path / "ckpt")


@pytest.mark.parametrize("backend", ["ram", "mmap", "disk"])
def test_from_pretrained_serves_tables_straight_from_the_shards(tmp_path, backend):
    from engram.integrations.qwen4_exp import from_pretrained

    ids = ids_with_eos(config(), 2, 12, 4)
    ref = tiny_model()
    ref.save_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        want = ref(ids).logits
    m = from_pretrained(tmp_path / "ckpt", tier=backend, dir=tmp_path / "t")
    assert m.model.layers[0].ple.ple_embedding.mhe.table.num_rows == sum(hash_mapping(config(
        ngram_vocab_size_base=5003)).head_sizes(1))
    with torch.no_grad():
        assert torch.equal(m(ids).logits, want)
    assert torch.equal(m.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0),
                       ref.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0))
    m.save_pretrained(tmp_path / "again")  # the tables go back into the checkpoint, padding rows included
    with torch.no_grad():
        assert torch.equal(mq.Qwen4ExpForCausalLM.from_pretrained(tmp_path / "again").eval()(ids).logits, want)
