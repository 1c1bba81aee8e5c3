#!/usr/bin/env bash
# Native replay on the lent H200 host: describe the host, install, probe every route, run host vs
# host_fixed (pairs, warm-ups, corruption), the GPU tests, the benchmark (baseline: fio) and the split of
# the gap to fio (replay_gap.py). Writes
# everything to $OUT (or ./h200-out). The figures in benchmarks/README.md ("Replay on the H200") come
# from this. The host has no package mirror: without a system fio, build/fio-bundle.tar.xz (Debian's
# fio and the libraries it links, packed on a machine that has it) is unpacked and used.
set -u -o pipefail
OUT=${OUT:-h200-out}; mkdir -p "$OUT"
W=${REPLAY_DIR:-/var/tmp/kmesh-replay}; rm -rf "$W"; mkdir -p "$W"
export PYTHONUNBUFFERED=1 COLUMNS=120
{
echo "== host"; date -u; uname -r; nproc; grep MemTotal /proc/meminfo
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cat /proc/sys/kernel/io_uring_disabled; python3 --version; findmnt -T "$W" -o TARGET,SOURCE,FSTYPE; ls /dev/nvme* 2>&1 | head -3
echo "== install"
if python3 -m pip install -q --no-build-isolation --no-deps -e . ; then K="kmesh-trace"
else  # fallback: build the engine with gcc and import from the tree
  gcc -O2 -std=gnu11 -shared -fPIC native/replay.c -o native/_kmesh_replay.so -ldl -lpthread || exit 1
  mkdir -p /tmp/pkg && cp -r kmesh_trace /tmp/pkg/ && for d in native oracle audit capture datasets; do ln -sfn "$PWD/$d" /tmp/pkg/kmesh_trace/$d; done
  export PYTHONPATH=/tmp/pkg; K="python3 -c 'from kmesh_trace.cli import main; main()'"
fi
echo "K=$K"
FIO=$(command -v fio || true)
if [ -z "$FIO" ] && [ -f build/fio-bundle.tar.xz ]; then
  tar xJf build/fio-bundle.tar.xz -C /tmp && export LD_LIBRARY_PATH=/tmp/contract-fio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  FIO=/tmp/contract-fio/fio
fi
echo "fio: $FIO ($($FIO --version 2>&1))"
echo "== probe"
eval $K replay probe --steps --dir "$W"
eval $K replay probe --json --dir "$W" > "$OUT/probe.json"
echo "== prepare + run"
eval $K replay prepare --out "$W/store" --num-restores 8
time eval $K replay run "$W/store" --routes host,host_fixed --pairs 4 --restores 100 --warmup 5 --corrupt 2 --out "$OUT/run"
echo "== tests"
python3 -m pytest -q -rs -p no:cacheprovider tests/test_replay.py tests/test_replay_gpu.py -s 2>&1 | tail -60
echo "== bench"
python3 benchmarks/replay_bench.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --gpu --json "$OUT/bench.json"
python3 benchmarks/replay_bench.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --depth 16 --json "$OUT/bench-depth16.json"
python3 benchmarks/replay_bench.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --workers 2 --json "$OUT/bench-workers2.json"
echo "== gap to fio (huge vs 4 KiB pages, one streamed call, drain)"
python3 benchmarks/replay_gap.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --json "$OUT/gap.json"
python3 benchmarks/replay_gap.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --depth 16 --json "$OUT/gap-depth16.json"
python3 benchmarks/replay_gap.py --fio "$FIO" --dir "$W" --restores 8 --rounds 3 --workers 2 --json "$OUT/gap-workers2.json"
} 2>&1 | tee "$OUT/log"
