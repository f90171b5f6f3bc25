"""Render deploy/helm/splitserve as `helm template` does, and check each manifest against its schema, offline.

The renderer is Helm's own engine: helm-python-sdk binds Helm v4's Go SDK (a native library in its wheel), so
rendering also checks the values against the chart's values.schema.json, as `helm template` does. Built-in
kinds are checked by kubernetes-validate (the API's published schemas, strict: unknown fields refused) for the
oldest and newest Kubernetes the chart supports; KEDA's ScaledObject and the Prometheus Operator's
ServiceMonitor against schemas generated from their CRDs (tests/deploy/schemas/, scripts/crd-schema.py).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.service_harness import REPO

CHART = REPO / "deploy/helm/splitserve"
VALUES_FILES = sorted((CHART / "ci").glob("*-values.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
}
# Chart.yaml's kubeVersion floor and the newest version kubernetes-validate ships
KUBE_VERSIONS = ("1.27.0", "1.37.0")
RELEASE, NAMESPACE = "splitserve", "llm"


@functools.cache
def _chart():
    import helm_python

    helm_python.disable_logging()  # it logs the dashboard's symbolic link on every load
    return helm_python.Chart.load(str(CHART))


def load_values(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def render(values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    """The manifests `helm template RELEASE CHART -n NAMESPACE` prints for these values, parsed, in file order."""
    manifests = _chart().render(values or {}, name=release, namespace=namespace)
    docs: list[dict] = []
    for path in sorted(manifests):
        if path.endswith(".yaml"):
            docs += [doc for doc in yaml.safe_load_all(manifests[path]) if doc]
    return docs


def lint(values: dict[str, Any] | None = None) -> dict[str, Any]:
    """`helm lint --strict -n NAMESPACE` of the chart with these values: {"messages": [...], "errors": [...]}."""
    import helm_python

    _chart()  # logging off
    return helm_python.lint(str(CHART), values or {}, strict=True, namespace=NAMESPACE)


def notes(values: dict[str, Any] | None = None) -> str:
    return _chart().render(values or {}, name=RELEASE, namespace=NAMESPACE)["splitserve/templates/NOTES.txt"]


def by_kind(docs: list[dict]) -> dict[tuple[str, str], dict]:
    """(kind, name) -> manifest; a repeated pair is an error (two objects would collide in the cluster)."""
    out: dict[tuple[str, str], dict] = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = doc
    return out


@functools.cache
def _validator(api_version: str, kind: str, kube_version: str):
    """A validator built once per schema: kubernetes-validate's own validate() re-reads and re-parses the 1.8 MB
    definitions file on every call (4 s of this file's run on a busy 2-core machine)."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    if (api_version, kind) in CRD_SCHEMAS:
        return jsonschema.Draft7Validator(json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text()))
    # the package's layout: v<version>-local-strict/<kind>-<group without domain>-<version>.json
    folder = f"kubernetes-json-schema/v{kube_version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group_version}.json", kube_version)
    definitions = utils.schema_contents(f"{folder}/_definitions.json", kube_version)
    registry = Resource.from_contents(schema) @ (Resource.from_contents(definitions) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def schema_errors(doc: dict) -> list[str]:
    """Every schema error of one manifest (empty = valid), each naming the field's path."""
    key = (doc.get("apiVersion", ""), doc.get("kind", ""))
    versions = ("",) if key in CRD_SCHEMAS else KUBE_VERSIONS
    out = []
    for version in versions:
        where = f"{key[1]} on {version}" if version else key[1]
        try:
            validator = _validator(*key, version)
        except FileNotFoundError:
            out.append(f"{where}: no schema for {key[0]}")
            continue
        for error in validator.iter_errors(doc):
            out.append(f"{where}: {'.'.join(map(str, error.absolute_path))}: {error.message}")
    return out


def container(doc: dict) -> dict:
    (only,) = doc["spec"]["template"]["spec"]["containers"]
    return only


def flag(args: list[str], name: str) -> str:
    """The value after `name` in an argument list (it must appear exactly once)."""
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]
