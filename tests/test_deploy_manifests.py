"""deploy/kubernetes/ holds valid manifests (checked offline against the Kubernetes schemas that
kubernetes-validate ships, strict: an unknown field fails) that agree with ``serve``: the probes on the API
port (``--port`` + 3) at ``/ready`` and ``/health``, a grace period longer than the preStop plus the drain,
the key from a Secret, the Service and the HPA pointing at the Deployment, the HPA's metrics made by the
adapter's rules from gauges the router exports."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
VERSION = "1.33"


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d}


def test_every_manifest_passes_the_schema_check():
    docs = _docs()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    for doc in docs.values():
        assert kubernetes_validate.validate(doc, VERSION, strict=True) == VERSION
    bad = {**docs["Service"], "spec": {**docs["Service"]["spec"], "portz": []}}  # the check is real
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def _arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_manifests_agree_with_serve():
    from elastic_export.serving.api_guard import API_KEY_ENV

    docs = _docs()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    api_port = int(_arg(c["args"], "--port")) + 3
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["api"] == api_port and ports["triton-metrics"] == api_port - 1
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "api"}
    assert c["livenessProbe"]["httpGet"] == c["startupProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    pre_stop = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + float(_arg(c["args"], "--drain-timeout"))
    (key,) = [e for e in c["env"] if e["name"] == API_KEY_ENV]
    assert "secretKeyRef" in key["valueFrom"] and _arg(c["args"], "--host") == "0.0.0.0"
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert docs["Service"]["spec"]["ports"][0]["targetPort"] == "api"
    target = docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment" and target["name"] == docs["Deployment"]["metadata"]["name"]
    rules = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"]
    made = {r["name"]["as"] for r in rules}
    asked = {m["pods"]["metric"]["name"] for m in docs["HorizontalPodAutoscaler"]["spec"]["metrics"]}
    assert asked <= made
    router = (ROOT / "elastic_export" / "serving" / "router_metrics.py").read_text()
    for r in rules:  # every series a rule reads is a gauge the router exports
        for name in ("in_flight", "densest_predicted_latency_ms", "slo_ms"):
            if f"elastic_router_{name}" in r["seriesQuery"] + r["metricsQuery"]:
                assert f'"{name}"' in router or f"elastic_router_{name}" in router, name
