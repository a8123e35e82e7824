"""`trace record --prompts FILE`: routing traces of the user's own prompts (text lines or JSONL), in the dtype the
checkpoint is served in (named in the metadata), readable by `analyze`; bad prompt files are one line and exit 2."""

import json
import shutil

import pytest
import torch
from tiny_lm import make_tiny_checkpoint, one_torch_thread  # noqa: F401 - autouse fixture

from expertcache.recipes.cli import main
from expertcache.telemetry.parquet_trace import read_meta
from expertcache.telemetry.routing import load_routing


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("prompts")
    fp32 = make_tiny_checkpoint(root / "fp32")
    bf16 = root / "bf16"
    AutoModelForCausalLM.from_pretrained(fp32).to(torch.bfloat16).save_pretrained(bf16)
    for f in fp32.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy2(f, bf16 / f.name)
    return {"fp32": fp32, "bf16": bf16}


@pytest.mark.slow  # records and analyzes a trace (about 1 s)
def test_own_prompts_are_recorded_in_the_served_dtype_and_analyzed(ckpts, tmp_path, capsys):
    from expertcache.telemetry.hf import load_tokenizer

    lines = ["thou art a word", "", "to be or not to be that is the question of the day", "é ü 字 hello"]
    txt = tmp_path / "p.txt"
    txt.write_text("\n".join(lines) + "\n")
    out = tmp_path / "t.parquet"
    assert main(["trace", "record", "--model", str(ckpts["bf16"]), "--out", str(out), "--prompts", str(txt),
                 "--prompt_len", "8", "--decode_tokens", "3"]) == 0
    meta = read_meta(out)
    assert meta.dtype == "bfloat16" and meta.corpus == str(txt)  # the dtype it ran in, the file it read
    tok = load_tokenizer(str(ckpts["bf16"]))
    lens = [min(8, len(tok(t, add_special_tokens=False)["input_ids"])) for t in lines if t.strip()]
    pre = load_routing(out, "prefill")
    dec = load_routing(out, "decode")
    layers = meta.num_layers if meta.moe_layers is None else len(meta.moe_layers)
    assert pre.ids.shape[:2] == (layers, sum(lens))  # every prompt token of the 3 prompts, at most 8 each
    assert dec.ids.shape[:2] == (layers, 3 * len(lens))
    capsys.readouterr()
    assert main(["analyze", "--trace", str(out), "--out", str(tmp_path / "an")]) == 0
    assert (tmp_path / "an").is_dir()
    rec32 = tmp_path / "t32.parquet"
    assert main(["trace", "record", "--model", str(ckpts["bf16"]), "--out", str(rec32), "--prompts", str(txt),
                 "--prompt_len", "8", "--decode_tokens", "3", "--dtype", "fp32"]) == 0
    assert read_meta(rec32).dtype == "float32"


def test_jsonl_prompts_take_their_field(ckpts, tmp_path):
    js = tmp_path / "p.jsonl"
    js.write_text("\n".join(json.dumps({"q": q, "id": i}) for i, q in enumerate(["a word", "another word here"])))
    out = tmp_path / "j.parquet"
    assert main(["trace", "record", "--model", str(ckpts["fp32"]), "--out", str(out), "--prompts", str(js),
                 "--field", "q", "--decode_tokens", "2", "--domain", "mine", "--max_prompts", "1"]) == 0
    r = load_routing(out, "decode")
    assert r.ids.shape[1] == 2  # one prompt (--max_prompts 1), two decode steps
    assert read_meta(out).dtype == "float32"


@pytest.mark.parametrize("content,extra,msg", [
    ("\n\n  \n", [], "holds no prompt text"),
    ('{"text": "x"}\nnot json\n', [], ":2: not JSON"),
    ('{"prompt": "x"}\n', [], "no string field 'text'"),
    ("x\n", ["--dtype", "int3"], "--dtype 'int3'"),
    ("x\n", ["--max_prompts", "-1"], "max_prompts=-1"),
])
def test_bad_prompt_files_are_one_line(ckpts, tmp_path, capsys, content, extra, msg):
    f = tmp_path / ("p.jsonl" if content.startswith("{") or "json" in content else "p.txt")
    f.write_text(content)
    out = tmp_path / "x.parquet"
    assert main(["trace", "record", "--model", str(ckpts["fp32"]), "--out", str(out), "--prompts", str(f),
                 *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0], err
    assert not out.exists()


def test_prompts_from_a_local_datasets_dataset(ckpts, tmp_path):
    """A `datasets` dataset saved with save_to_disk (a DatasetDict: FOLDER:SPLIT picks the split), the prompt in
    the column --field names; a folder that is not one, a missing split or column: one line, exit 2."""
    import datasets

    rows = {"question": ["thou art a word", "to be or not to be", "  "], "id": [1, 2, 3]}
    d = tmp_path / "ds"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({"question": ["my lord"], "id": [4]})}).save_to_disk(d)
    out = tmp_path / "t.parquet"
    args = ["trace", "record", "--model", str(ckpts["fp32"]), "--prompt_len", "8", "--decode_tokens", "2",
            "--field", "question", "--out", str(out)]
    assert main([*args, "--prompts", str(d)]) == 0
    assert read_meta(out).extra["prompts"] == 2  # the blank one skipped
    assert main([*args, "--prompts", f"{d}:test"]) == 0 and read_meta(out).extra["prompts"] == 1
    for bad in (f"{d}:nosplit", str(tmp_path)):
        assert main([*args, "--prompts", bad]) == 2
    assert main([*args[:-4], "--field", "nothere", "--out", str(out), "--prompts", str(d)]) == 2
