#!/bin/bash
M=/work/shared/datasets/mooncake/conversation_trace.jsonl
W=/work/shared/datasets/weka-claude-code
W7=/tmp/weka7
uptime
for round in 1 2 3; do
for src in $M $W $W7; do
for cmd in "tiers --capacity-blocks 4000 --host 16000 --json" "fleet --capacity-blocks 4000 --json" "lineage --json" "headroom --capacity-blocks 4000 --policies lru,belady --json"; do
  set -- $cmd; c=$1; shift
  if [ $src = $M ] && [ $c = headroom ]; then continue; fi
  for side in before after; do
    if [ $side = before ]; then K=/tmp/base26i/.venv/bin/kmesh-trace; else K=/work/wt-26i/.venv/bin/kmesh-trace; fi
    /usr/bin/time -o /tmp/m26i.time -f "%e %M" $K $c $src "$@" > /tmp/m26i.$side.out 2>/dev/null; r=$(cat /tmp/m26i.time)
    echo "$round $(basename $src) $c $side $r"
  done
  cmp -s /tmp/m26i.before.out /tmp/m26i.after.out && echo "  identical" || echo "  DIFFERENT OUTPUT"
done; done; done
uptime
