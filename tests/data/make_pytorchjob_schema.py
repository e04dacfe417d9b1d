"""How tests/data/pytorchjob_v1.schema.json.gz was made: the openAPIV3Schema of the
PyTorchJob CRD (kubeflow.org/v1) from the Kubeflow Training Operator's own manifests, tag
v1.9.0 (commit 6f74c7f6b2ed6c27aabd82d0a316b23f0646059c), as the API server validates a
PyTorchJob against it. The v1 CRD left the repository's main branch with the move to
Kubeflow Trainer v2, so the last release that ships it is used.

    git -C training-operator show v1.9.0:manifests/base/crds/kubeflow.org_pytorchjobs.yaml \\
        > /tmp/pytorchjob-crd.yaml
    python tests/data/make_pytorchjob_schema.py /tmp/pytorchjob-crd.yaml
"""

import gzip
import json
import sys
from pathlib import Path

import yaml

crd = next(d for d in yaml.safe_load_all(Path(sys.argv[1]).read_text()) if d)
(version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
out = Path(__file__).with_name("pytorchjob_v1.schema.json.gz")
out.write_bytes(gzip.compress(json.dumps(version["schema"]["openAPIV3Schema"],
                                         sort_keys=True).encode(), mtime=0))
print(f"wrote {out} ({out.stat().st_size} bytes)")
