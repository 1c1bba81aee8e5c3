#!/usr/bin/env bash
# Native replay on the lent H200 host, wave 2: every route the host can run (host, host_fixed, and cufile in
# the mode it can run, compatibility mode on a disk without GDS), paired and verified, plus an fio baseline
# (io_uring, O_DIRECT) at the routes' queue depth and read size over the same store files. Writes everything
# to $OUT. Usage there: OUT=... FIO=path/to/fio bash benchmarks/replay_h200_cufile.sh
set -u -o pipefail
OUT=${OUT:-h200-out}; mkdir -p "$OUT"
W=${REPLAY_DIR:-/var/tmp/kmesh-replay}; rm -rf "$W"; mkdir -p "$W"
FIO=${FIO:-fio}
export PYTHONUNBUFFERED=1 COLUMNS=120
{
echo "== host"; date -u; uname -r; nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ls /proc/driver/nvidia-fs 2>&1 | head -2; lsmod 2>/dev/null | grep -i nvidia_fs; findmnt -T "$W" -o TARGET,SOURCE,FSTYPE
echo "== install"
python3 -m pip install -q --no-build-isolation --no-deps -e . || exit 1
echo "== probe"
KMESH_CUFILE_UDEV= kmesh-trace replay probe --steps --dir "$W"   # as found: this VM runs no udev
# cuFile needs udev's record of the disk (native/cufile.py); with no udev here, kmesh-trace writes it.
export KMESH_CUFILE_UDEV=write
kmesh-trace replay probe --steps --dir "$W"
kmesh-trace replay probe --json --dir "$W" > "$OUT/probe.json"
echo "== prepare + run"
kmesh-trace replay prepare --out "$W/store" --num-restores 8
time kmesh-trace replay run "$W/store" --routes host,host_fixed,cufile --pairs 4 --restores 100 --warmup 5 --corrupt 2 --out "$OUT/run"
kmesh-trace replay run "$W/store" --routes host,cufile --pairs 4 --restores 100 --warmup 5 --depth 16 --out "$OUT/run-depth16" | tail -8
echo "== fio baseline: io_uring, O_DIRECT, depth 8, 3 MiB reads over the store's files (the routes' depth and chunk size)"
files=$(find "$W/store" -type f -name '*.bin' -o -type f -name '*.dat' | sort | tr '\n' ':' | sed 's/:$//')
[ -n "$files" ] || files=$(find "$W/store" -type f -size +1M | sort | tr '\n' ':' | sed 's/:$//')
echo "files: $files"
for rep in 1 2 3; do
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null
  "$FIO" --name=base --ioengine=io_uring --direct=1 --rw=read --bs=3M --iodepth=8 --filename="$files" \
     --size=384M --output-format=json --output="$OUT/fio-$rep.json" && \
  python3 -c "import json,sys; j=json.load(open('$OUT/fio-$rep.json'))['jobs'][0]['read']; print('fio rep $rep: %.2f GB/s, clat p50 %.2f ms' % (j['bw_bytes']/1e9, j['clat_ns']['percentile']['50.000000']/1e6))"
done
echo "== tests"
python3 -m pytest -q -rs -p no:cacheprovider tests/test_replay.py tests/test_replay_gpu.py tests/test_cufile_mode.py 2>&1 | tail -30
} 2>&1 | tee "$OUT/log.txt"
