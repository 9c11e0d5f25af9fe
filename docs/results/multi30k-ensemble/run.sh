#!/usr/bin/env bash
# Multi30k En-De test_2016_flickr: two seeds of the multi30k_en_de preset (train.max_steps=2500, the
# averaged last 5 checkpoints of each), each alone and as an ensemble, beam 4 (the preset's), then the
# paired bootstrap test of the ensemble against each member. Run from the repository root:
#   bash docs/results/multi30k-ensemble/run.sh RUNS_DIR
# RUNS_DIR holds s1/sinusoidal and s2/sinusoidal (tpe-study run directories).
set -euo pipefail
runs=${1:?give the runs directory of the study}
out=docs/results/multi30k-ensemble
a=$(ls -d "$runs"/s1/sinusoidal/averaged-last5 | head -1)
b=$(ls -d "$runs"/s2/sinusoidal/averaged-last5 | head -1)
{
  echo "revision: $(git rev-parse HEAD)"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(nproc) CPU cores, torch $(python -c 'import torch; print(torch.__version__)')"
  echo "members: $a $b"
} > "$out/provenance.txt"
split=test_2016_flickr
/usr/bin/time -f "%e s" -o "$out/time-s1.txt" tpe-eval --checkpoint "$a" --split $split --out "$out/s1"
/usr/bin/time -f "%e s" -o "$out/time-s2.txt" tpe-eval --checkpoint "$b" --split $split --out "$out/s2"
/usr/bin/time -f "%e s" -o "$out/time-ensemble.txt" \
  tpe-eval --checkpoint "$a" "$b" --split $split --out "$out/ensemble"
python "$out/paired.py" "$out" $split "${MULTI30K:-../shared/data/multi30k}/$split.de" > "$out/paired.json"
cat "$out/paired.json"
