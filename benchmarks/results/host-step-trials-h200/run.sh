#!/bin/bash
# The in-process A/B of one trial, from the checkout's root on a GPU machine (OUT: where results go):
#   bash benchmarks/results/host-step-trials-h200/run.sh matchers-pool new base new base
#   bash benchmarks/results/host-step-trials-h200/run.sh token-buckets new base new base
# "new" is the checkout with the trial's variant.diff applied (in /tmp/new), "base" the checkout as
# it is; each run is one process of structured_engine_profile, in the order given.
trial=$1; shift
here=benchmarks/results/host-step-trials-h200
mkdir -p $OUT/$trial
if [ ! -d /tmp/new ]; then
  mkdir -p /tmp/new && tar --exclude=./.gpu --exclude=./.venv --exclude=./servekit/handlers --exclude=./servekit/optimizations \
    --exclude=./servekit/benchmarks --exclude=./servekit/config --exclude=./servekit/k8s -cf - . | tar -xf - -C /tmp/new
  (cd /tmp/new && patch -p1 -s < $here/$trial/variant.diff) || { echo "the variant does not apply" >&2; exit 1; }
fi
i=0
for tree in "$@"; do
  i=$((i+1)); dir=$PWD; [ $tree = new ] && dir=/tmp/new
  echo "== $i $tree $(date +%T)" | tee -a $OUT/$trial/console.log
  (cd $dir && source benchmarks/gpu_env.sh >/dev/null 2>&1 && timeout 200 python3 -m servekit.benchmarks.structured_engine_profile \
    --requests 32 --repeats 2 --closed-loop 256 2>&1 | grep -E "^(free|JSON|comparison)" | tee $OUT/$trial/$i-$tree.log \
    | grep -E "comparison|JSON" | tee -a $OUT/$trial/console.log)
done
