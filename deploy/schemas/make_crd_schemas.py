"""Regenerate the custom-resource JSON schemas in this folder (run rarely).

The Kubernetes core kinds are validated with ``kubernetes-validate``, which
bundles the official schemas. The custom resources our manifests use are not
in it, so their schemas are derived here from models that the projects'
own schemas generate, published on PyPI (no other download):

- ``podmonitor_v1.json``, ``prometheusrule_v1.json``: from
  ``cloudcoil-models-prometheus-operator==0.80.1.0`` (pydantic models
  generated from prometheus-operator v0.80.1's CRDs).
- ``pytorchjob_v1.json``: from ``kubeflow-training==1.9.4`` (the Training
  Operator's OpenAPI v1.9.4 models). Its pod templates are left open here:
  tests validate each replica's template against the core PodTemplateSpec
  schema with kubernetes-validate instead.

Unknown fields are rejected (``additionalProperties: false``), as
``kubectl apply`` does by default (server-side strict field validation).

Run in a throw-away virtualenv, from the repository root:

    python -m venv /tmp/crd-venv
    /tmp/crd-venv/bin/pip install cloudcoil-models-prometheus-operator==0.80.1.0 kubeflow-training==1.9.4
    /tmp/crd-venv/bin/python deploy/schemas/make_crd_schemas.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
POD_TEMPLATE_NOTE = ("core/v1 PodTemplateSpec: validated against the Kubernetes schema with "
                     "kubernetes-validate (kind PodTemplate), not here")


def forbid_unknown_fields(node: object) -> None:
    """additionalProperties: false on every object schema that lists properties.

    Also moves Go's mid-pattern case-insensitive flag (``^(?i)...``) to the
    front, where Python's re (used by jsonschema) accepts it."""
    if isinstance(node, dict):
        if node.get("properties") and "additionalProperties" not in node:
            node["additionalProperties"] = False
        if isinstance(node.get("pattern"), str) and node["pattern"].startswith("^(?i)"):
            node["pattern"] = "(?i)^" + node["pattern"][len("^(?i)"):]
        for value in node.values():
            forbid_unknown_fields(value)
    elif isinstance(node, list):
        for value in node:
            forbid_unknown_fields(value)


def prometheus_operator_schema(model: type, source: str) -> dict:
    schema = model.model_json_schema(by_alias=True)
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    forbid_unknown_fields(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": source, **schema}


# --- kubeflow-training's OpenAPI-generator models -> JSON schema -------------

_REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")
_PRIMITIVES = {"str": {"type": "string"}, "int": {"type": "integer"}, "bool": {"type": "boolean"},
               "float": {"type": "number"}, "object": {}, "datetime": {"type": "string"},
               # Kubernetes' resource.Quantity and IntOrString: "500m", "1Gi", 2
               "Quantity": {"type": ["string", "number"]}, "IntOrString": {"type": ["string", "integer"]}}


def _model_class(name: str) -> type:
    # The Kubeflow models name some Kubernetes types by their Go package
    # (K8sIoApiAutoscalingV2MetricSpec); the Kubernetes client calls it V2MetricSpec.
    if m := re.fullmatch(r"K8sIoApi[A-Z][a-z]+(V\d\w*)", name):
        name = m.group(1)
    for module in ("kubeflow.training.models", "kubernetes.client.models"):
        mod = importlib.import_module(module)
        if hasattr(mod, name):
            return getattr(mod, name)
    raise LookupError(name)


def _type_schema(type_name: str, defs: dict) -> dict:
    if type_name in _PRIMITIVES:
        return dict(_PRIMITIVES[type_name])
    if m := re.fullmatch(r"list\[(.+)\]", type_name):
        return {"type": "array", "items": _type_schema(m.group(1), defs)}
    if m := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        return {"type": "object", "additionalProperties": _type_schema(m.group(1), defs)}
    if type_name == "V1PodTemplateSpec":
        return {"type": "object", "description": POD_TEMPLATE_NOTE}
    if type_name not in defs:
        defs[type_name] = {}  # placeholder: breaks reference cycles
        cls = _model_class(type_name)
        required = {cls.attribute_map[a] for a in _REQUIRED.findall(inspect.getsource(cls))}
        properties = {cls.attribute_map[attr]: _type_schema(t, defs) for attr, t in cls.openapi_types.items()}
        defs[type_name] = {"type": "object", "properties": properties, "required": sorted(required)}
        if not defs[type_name]["required"]:
            del defs[type_name]["required"]
    return {"$ref": f"#/$defs/{type_name}"}


def pytorchjob_schema() -> dict:
    defs: dict = {}
    root = _type_schema("KubeflowOrgV1PyTorchJob", defs)["$ref"].rsplit("/", 1)[1]
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema",
              "$comment": "kubeflow.org/v1 PyTorchJob, from kubeflow-training==1.9.4 (OpenAPI v1.9.4); "
                          "regenerate with deploy/schemas/make_crd_schemas.py",
              **defs.pop(root), "$defs": defs}
    schema["properties"]["apiVersion"] = {"const": "kubeflow.org/v1"}
    schema["properties"]["kind"] = {"const": "PyTorchJob"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    forbid_unknown_fields(schema)
    return schema


def main() -> None:
    from cloudcoil.models.prometheus_operator import v1

    source = ("monitoring.coreos.com/v1 {kind}, from cloudcoil-models-prometheus-operator==0.80.1.0 "
              "(prometheus-operator v0.80.1 CRDs); regenerate with deploy/schemas/make_crd_schemas.py")
    schemas = {
        "podmonitor_v1.json": prometheus_operator_schema(v1.PodMonitor, source.format(kind="PodMonitor")),
        "prometheusrule_v1.json": prometheus_operator_schema(v1.PrometheusRule, source.format(kind="PrometheusRule")),
        "pytorchjob_v1.json": pytorchjob_schema(),
    }
    for name, schema in schemas.items():
        (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
