#!/bin/bash
# whole-process time and peak RSS of headroom, exact default and sampled, at 10 M and 94 M reads
cd /work/wt-39
for src in /tmp/kmesh-agentic-10000000-60.jsonl /tmp/kmesh-agentic-94000000-60.jsonl; do
  for arm in "" "--sample 0.01" "--sample 0.1"; do
    echo "== $src $arm load $(cut -d' ' -f1 /proc/loadavg)"
    /usr/bin/time -f "TIME %e s %U user %M KiB" prlimit --as=10000000000 .venv/bin/kmesh-trace headroom $src --window last-half --json $arm > /tmp/t39/out.json 2>/tmp/t39/err.txt
    tail -1 /tmp/t39/err.txt
  done
done
