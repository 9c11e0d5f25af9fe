"""The paired bootstrap test (tpe_train.evaluation.metrics.paired_bootstrap, as tpe-eval --compare and
tpe-study use it) of the ensemble's scored hypotheses against each member's, from the directories
tpe-eval --out wrote: python paired.py DIR SET > paired.json"""

import json
import sys
from pathlib import Path

from tpe_train.evaluation.evaluate import EvalFiles
from tpe_train.evaluation.metrics import paired_bootstrap

folder, name = Path(sys.argv[1]), sys.argv[2]
ens_hyp, refs = EvalFiles(folder / "ensemble").read_set(name)  # type: ignore[misc]
out = {}
for member in ("s1", "s2"):
    hyp, member_refs = EvalFiles(folder / member).read_set(name)  # type: ignore[misc]
    assert member_refs == refs
    out[f"ensemble vs {member}"] = paired_bootstrap(ens_hyp, hyp, refs, 1000).as_dict()
print(json.dumps(out, indent=2))
