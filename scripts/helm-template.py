#!/usr/bin/env python3
"""`helm template` without a helm binary: render a chart with Helm's own engine (helm-python-sdk, in the dev
extra), values files and --set applied as helm applies them, the values checked against values.schema.json.

    .venv/bin/python scripts/helm-template.py RELEASE deploy/helm/splitserve -n NAMESPACE [-f VALUES]... [--set K=V]...
    ... | kubectl apply -n NAMESPACE -f -

Note: `kubectl apply` cannot remove what a later render drops (a pool turned off); `helm upgrade` does.
"""

from __future__ import annotations

import argparse
import sys

import yaml


def merge(base: dict, top: dict) -> dict:
    """Helm's rule for -f and --set: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release")
    parser.add_argument("chart")
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("-f", "--values", action="append", default=[], help="a values file (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE as helm's --set (repeatable)")
    args = parser.parse_args(argv)

    import helm_python

    helm_python.disable_logging()
    values: dict = {}
    for path in args.values:
        values = merge(values, yaml.safe_load(open(path)) or {})
    for expression in args.set:
        values = merge(values, helm_python.parse_set_string(expression))
    try:
        manifests = helm_python.Chart.load(args.chart).render(values, name=args.release, namespace=args.namespace)
    except helm_python.HelmError as exc:
        print(f"helm-template: {exc}", file=sys.stderr)
        return 1
    for path in sorted(manifests):
        if path.endswith(".yaml") and manifests[path].strip():
            body = manifests[path].strip("\n")
            sys.stdout.write(f"---\n# Source: {path}\n{body.removeprefix('---').lstrip(chr(10))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
