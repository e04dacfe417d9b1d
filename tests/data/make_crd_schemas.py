"""How tests/data/*.schema.json.gz were made: the openAPIV3Schema of each Kubeflow CRD that
`tessel launch k8s` writes a job for, from the project's own manifests, as the API server
validates a job against it.

- pytorchjob_v1.schema.json.gz: PyTorchJob (kubeflow.org/v1), Kubeflow Training Operator
  tag v1.9.0 (commit 6f74c7f6b2ed6c27aabd82d0a316b23f0646059c). The v1 CRD left the
  repository's main branch with the move to Kubeflow Trainer v2, so the last release that
  ships it is used.

      git -C training-operator show v1.9.0:manifests/base/crds/kubeflow.org_pytorchjobs.yaml \\
          > /tmp/pytorchjob-crd.yaml
      python tests/data/make_crd_schemas.py /tmp/pytorchjob-crd.yaml v1 pytorchjob_v1

- trainjob_v1alpha1.schema.json.gz: TrainJob (trainer.kubeflow.org/v1alpha1), Kubeflow
  Trainer main at commit 8c0f5059b (2026-11; the CRD last changed in 8f6c5f067, 2026-08-12).

      git -C trainer show 8c0f5059b:manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml \\
          > /tmp/trainjob-crd.yaml
      python tests/data/make_crd_schemas.py /tmp/trainjob-crd.yaml v1alpha1 trainjob_v1alpha1
"""

import gzip
import json
import sys
from pathlib import Path

import yaml

crd_file, version_name, stem = sys.argv[1:4]
crd = next(d for d in yaml.safe_load_all(Path(crd_file).read_text()) if d)
(version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name]
out = Path(__file__).with_name(f"{stem}.schema.json.gz")
out.write_bytes(gzip.compress(json.dumps(version["schema"]["openAPIV3Schema"],
                                         sort_keys=True).encode(), mtime=0))
print(f"wrote {out} ({out.stat().st_size} bytes)")
