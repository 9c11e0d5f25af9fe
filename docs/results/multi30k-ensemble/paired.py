"""The paired bootstrap test (tpe_train.evaluation.metrics.paired_bootstrap, as tpe-eval --compare and
tpe-study use it) of the ensemble's scored hypotheses against each member's, from the directories
tpe-eval --out wrote and the corpus's reference file (not committed here):
python paired.py DIR SET REFERENCES > paired.json, e.g.
python paired.py . test_2016_flickr ../../../../shared/data/multi30k/test_2016_flickr.de"""

import json
import sys
from pathlib import Path

from tpe_train.evaluation.decoding import read_lines
from tpe_train.evaluation.metrics import paired_bootstrap

folder, name, references = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
refs = read_lines(references)


def hypotheses(run: str) -> list[str]:
    return read_lines(folder / run / "hypotheses" / f"{name}.hyp")


ens_hyp = hypotheses("ensemble")
out = {}
for member in ("s1", "s2"):
    out[f"ensemble vs {member}"] = paired_bootstrap(ens_hyp, hypotheses(member), refs, 1000).as_dict()
print(json.dumps(out, indent=2))
