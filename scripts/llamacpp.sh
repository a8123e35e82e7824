#!/bin/sh
# llama.cpp, the peer (not part of `make test`): build it from the PyPI sdist `llama-cpp-python`'s vendored source
# (cached in $EXPERTCACHE_LLAMACPP, default ~/.cache/expertcache/llamacpp; about 30 minutes on 2 cores), convert a
# checkpoint with the converter that ships in that source and time decode with its own llama-bench:
#   scripts/llamacpp.sh --build_only
#   scripts/llamacpp.sh --model /path/to/hf-checkpoint --formats bf16,q8_0,q4_0 --threads 1 --tokens 32
# `expertcache bench big --routing native --systems [expertcache:on-demand,llama.cpp,llama.cpp:unbounded,...]`
# runs it beside expertcache on the checkpoint bigger than memory (the same steps, from Python).
set -e
here=$(dirname "$0")
exec "${PYTHON:-$here/../.venv/bin/python}" "$here/llamacpp_peer.py" "$@"
