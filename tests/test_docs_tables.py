"""README.md and docs/*.md: every marked table is the generator's output (scripts/readme_tables.py), so a figure
cannot drift from its results file, and no page carries a machine's absolute paths outside code typed as is."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("readme_tables", ROOT / "scripts" / "readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def generated(gen):
    return gen.tables()


def test_readme_and_docs_equal_the_generator(gen, generated):
    assert gen.stale(generated) == [], "run `python scripts/readme_tables.py --write`"


def test_the_readme_carries_the_headline_and_the_make_times(gen, generated):
    text = (ROOT / "README.md").read_text()
    for name in ("headline", "make_times"):
        assert f"<!-- table:{name} -->" in text and f"<!-- /table:{name} -->" in text
    assert "results/bench_big.json" in generated["headline"]  # a figure from a results file, not typed
    marked = {m.group("name") for p in gen.documents() for m in gen.MARKED.finditer(p.read_text())}
    assert marked <= set(generated), marked - set(generated)
    assert len(marked) >= 15, marked


def test_a_drifted_table_is_caught_and_rewritten(gen, generated):
    text = "intro\n<!-- table:headline -->\n| old | figure |\n<!-- /table:headline -->\nafter\n"
    out = gen.rendered(text, generated)
    assert out != text and "| old | figure |" not in out
    assert out == f"intro\n<!-- table:headline -->\n{generated['headline']}\n<!-- /table:headline -->\nafter\n"
    assert gen.rendered(out, generated) == out  # written once, it stays
    unknown = gen.rendered("<!-- table:nosuch -->\n<!-- /table:nosuch -->", generated)
    assert "no table named 'nosuch'" in unknown


FIGURE = re.compile(r"(?<![\w.])\d+\.\d+")  # a number with a decimal point: what a measurement prints
FIGURES_MAX = 3  # an unmarked table may quote a threshold or a definition's constant, not a run's figures


def unmarked_tables(text: str) -> list[tuple[int, int]]:
    """(first line, decimal figures) of every table outside fenced code and outside `<!-- table:NAME -->` markers."""
    out, marked, start, n = [], False, None, 0
    for i, line in _prose(text) + [(None, "")]:
        if line.startswith("<!-- table:"):
            marked = True
        elif line.startswith("<!-- /table:"):
            marked = False
        if line.startswith("|") and not marked:
            start, n = start or i, n + len(FIGURE.findall(line))
        elif start is not None:
            out.append((start, n))
            start, n = None, 0
    return out


def test_every_table_of_figures_is_generated(gen):
    """A table that holds a run's figures lives between markers, so the generator writes it from its results file;
    a table typed by hand (options, definitions, rooms) quotes at most FIGURES_MAX decimal numbers."""
    bad = [f"{p.relative_to(ROOT)}:{i}: {n} figures" for p in gen.documents()
           for i, n in unmarked_tables(p.read_text()) if n > FIGURES_MAX]
    assert not bad, "tables typed by hand with a run's figures (put them in a results file and the generator):\n" \
        + "\n".join(bad)
    planted = "text\n| run | tokens/s |\n|---|---|\n| a | 1.25 |\n| b | 2.50 |\n| c | 3.75 |\n| d | 5.00 |\n"
    assert unmarked_tables(planted) == [(2, 4)]  # the check itself can fail
    assert unmarked_tables(f"<!-- table:x -->\n{planted}<!-- /table:x -->\n") == []
    assert unmarked_tables(f"```\n{planted}```\n") == []


def test_make_times_read_not_measured_until_measured(gen):
    assert gen.make_times_table(None).count(gen.NOT_MEASURED) == 3
    t = gen.make_times_table({"make-test-fast": {"wall_s": 126.4, "exit": 0, "commit": "abc1234", "cpus": 2,
                                                 "machine": "x86_64", "load_after_1min": 1.5, "ci": False,
                                                 "when": "2026-01-01T00:00:00Z"}})
    assert "| `make test-fast` | 2 min 06 s | 0 | 2 CPUs x86_64 | 1.5 | — | abc1234 |" in t  # an older record
    assert t.count(gen.NOT_MEASURED) == 2
    t = gen.make_times_table({"make-test": {"wall_s": 61.0, "exit": 1, "commit": "abc1234", "cpus": 2,
                                            "machine": "x86_64", "load_after_1min": 1.5, "cpu_steal_s": 7.25}})
    assert "| `make test` | 1 min 01 s | 1 | 2 CPUs x86_64 | 1.5 | 7.2 s | abc1234 |" in t


def test_timed_counts_the_cpu_time_the_host_took():
    import importlib.util

    from helpers import REPO

    spec = importlib.util.spec_from_file_location("timed", REPO / "scripts" / "timed.py")
    timed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timed)
    a = timed.steal_s()
    if a is None:
        pytest.skip("no /proc/stat steal field here")
    assert a >= 0 and timed.steal_s() >= a  # a counter since boot


def test_provenance_carries_no_machine_paths(gen):
    cmd = ("python scripts/bench_kernels.py --model /work/ckpt/q30-4l --work /work/ckpt --out /work/bk/k9.json "
           "--x /tmp/a")
    assert gen.provenance(cmd, "kernels.json") == ("python scripts/bench_kernels.py --model CKPT --work WORKDIR "
                                                   "--out results/kernels.json --x PATH")


ABSOLUTE = re.compile(r"(?<![\w.~:/-])/(?:work|tmp|home|Users|root|mnt|scratch|data|opt|srv)/")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line, text) of every line outside fenced code blocks (code there is typed as is)."""
    out, code = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            code = not code
        elif not code:
            out.append((i, line))
    return out


def test_no_absolute_machine_paths_in_readme_and_docs(gen):
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in gen.documents()
           for i, line in _prose(p.read_text()) if ABSOLUTE.search(line)]
    assert not bad, "\n".join(bad)
    assert ABSOLUTE.search("measured with --model /work/ckpt/q30 here")  # the check itself can fail
    assert not ABSOLUTE.search("runs/ca-starter/model and results/bench_big.json")



def test_committed_run_configurations_carry_no_machine_paths():
    """results/*.config.yaml (what `--config` re-runs): no machine's folders. The CLI writes them so: an argument
    naming one is left out where the command has a default (an output folder), else made `.../<last name>`."""
    import yaml
    from jsonargparse import ArgumentParser

    from expertcache.recipes import cli
    from expertcache.runtime.bench.results import machine_paths

    bad = {p.name: k for p in (ROOT / "results").glob("*.config.yaml")
           for k, v in yaml.safe_load(p.read_text()).items() if machine_paths(v)}
    assert not bad, bad
    parser = ArgumentParser()
    parser.add_argument("--out_dir", default="runs/x")
    parser.add_argument("--model", default=None)
    parser.add_argument("--corpus", default="data/corpus")  # an input with a default: kept, made portable
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engine.tier", default="disk")
    parser.add_argument("--engine.miss_copy", default="")
    cfg = parser.parse_args(["--out_dir", "/work/bb48/run", "--model", "/tmp/ckpt/q30-4l", "--layers", "48",
                             "--corpus", "/work/data/corpus", "--engine.miss_copy", "/tmp/q4"])
    got = yaml.safe_load(cli._portable_config(parser.dump(cfg)))
    assert got == {"model": ".../q30-4l", "corpus": ".../corpus", "layers": 48,
                   "engine": {"tier": "disk", "miss_copy": ".../q4"}}
