#!/usr/bin/env bash
# The GPU check (issue #36): one short script the lead runs on the device machine (H100,
# torch 2.11, triton 3.6, Python 3.12, no network), from the checkout's root, with $OUT set.
# Whole script under 7 minutes (the caps add up to 395 s): every part has its own time cap; each part's output is tee'd
# into $OUT/<part>.txt and its exit status into $OUT/status.txt.
#
# Wheels: the lead downloads cp312 / py3 wheels into .gpu-wheels/ (untracked, carried with the
# working tree), e.g. `pip download --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .gpu-wheels PKG...` for:
#   msgspec orjson platformdirs rich markdown-it-py mdurl pygments      (kvspec's own imports)
#   hypothesis sortedcontainers attrs filelock                          (tests/conftest.py)
#   pytest pluggy iniconfig packaging                                   (if pytest is missing)
#   gguf pyyaml tqdm                                                    (impl/llm)
#   transformers tokenizers huggingface-hub safetensors regex requests urllib3 idna certifi
#   charset-normalizer                                                  (test_llm's HF oracle)
# They install with --no-index --no-deps into /tmp/site (nothing else is touched).
set -u
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
ROOT=$(pwd)
export PYTHONDONTWRITEBYTECODE=1
if [ -d .gpu-wheels ] && ls .gpu-wheels/*.whl >/dev/null 2>&1; then
  timeout 30 python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl \
    2>&1 | tail -5 | tee "$OUT/wheels.txt"
else
  echo "no .gpu-wheels/*.whl: using what the machine has" | tee "$OUT/wheels.txt"
fi
mkdir -p /tmp/pp && ln -sfn "$ROOT" /tmp/pp/kvspec  # the checkout's root is the kvspec package
export PYTHONPATH=/tmp/pp:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
unset TRITON_INTERPRET  # real kernels on the GPU

part() {  # part NAME SECONDS COMMAND...: run it capped, tee its output, record its status
  local name=$1 cap=$2
  shift 2
  local began=$SECONDS
  timeout "$cap" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "$name: exit $rc in $((SECONDS - began)) s (cap $cap s)" | tee -a "$OUT/status.txt"
}

part nvidia-smi 10 nvidia-smi
part import 15 python3 -c "import kvspec, torch, triton; print(kvspec.__file__, torch.__version__, triton.__version__, torch.cuda.is_available())"
part gpu_attention 130 python3 bench/gpu_attention.py --budget 115
TESTS="tests/test_kernels.py tests/test_replay.py tests/test_replay_groups.py"
if python3 -c "import transformers" 2>/dev/null; then
  TESTS="$TESTS tests/test_llm.py"
else
  echo "transformers missing: tests/test_llm.py not run" | tee -a "$OUT/status.txt"
fi
# shellcheck disable=SC2086
part pytest 150 python3 -m pytest -q -p no:cacheprovider -rs --durations=8 $TESTS
# full + window 512 + state, 8 requests of 2048 tokens, 32/8 heads of 128, float32 then bf16
part replay_hybrid 90 python3 bench/bench_replay_hybrid.py --dtypes float32,bfloat16
cat "$OUT/status.txt"
