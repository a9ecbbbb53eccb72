#!/usr/bin/env bash
# Hybrid and HSDP training, old (5631634) vs new binary alternating: char-lm on cpu, 2 nodes x 2
# ranks on loopback, 30 steps; one line per run: round strategy version step_ms comm_ms
# sent_bytes final_loss (medians of the summary line).
cd /tmp/bench2 && for round in 1 2 3; do for s in hybrid hsdp; do for v in old new; do
  timeout 300 /tmp/bench/$v/wiretrain launch --local 2 --ranks-per-node 2 -- train --example char-lm \
    --strategy $s --steps 30 --device cpu --metrics /tmp/bench2/m.jsonl > /dev/null 2>&1
  echo "$round $s $v $(tail -1 /tmp/bench2/m.jsonl | python3 -c "import json,sys; d=json.load(sys.stdin); m=d['median']; print(m['step_ms'], m['comm_ms'], m['sent_bytes'], d['final_loss'])")" >> hs-runs.txt
done; done; done
