"""Every manifest under launch/kuberay/ is one the Kubernetes API server would accept, and one
that runs rlcore as intended.

No API server runs here, so each RayJob / RayCluster is validated against the openAPIV3Schema of
KubeRay's CRDs (tests/data/kuberay/), made as strict as `kubectl apply` with server-side strict
field validation: a field the schema does not declare is an error, not silently pruned.
"""

from __future__ import annotations

import copy
import re
import shlex
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
KUBERAY_DIR = REPO / "launch" / "kuberay"
CRD_DIR = Path(__file__).resolve().parent / "data" / "kuberay"
CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
SHARED_CLAIM = "rlcore-shared"

# The part of ObjectMeta a manifest may set; the rest is written by the API server.
OBJECT_META = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        # KubeRay names Services and Pods after the resource (NAME-head-svc, ...), which must be
        # DNS-1123 labels, so the name itself has to be one with room to spare.
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 47},
        "namespace": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}

# Keywords whose values are data, not schemas: never rewrite inside them.
_DATA_KEYWORDS = {"default", "enum", "example", "x-kubernetes-validations", "required"}


def _strict(schema: Any) -> Any:
    """Close every object schema the CRD leaves open only by omission.

    Kubernetes prunes undeclared fields of a structural schema unless
    x-kubernetes-preserve-unknown-fields is set; with strict field validation it rejects them. A
    typo in a manifest would otherwise vanish without a word.
    """
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _DATA_KEYWORDS:
            out[key] = value
        elif key == "properties":
            out[key] = {name: _strict(sub) for name, sub in value.items()}
        else:
            out[key] = _strict(value)
    if (
        out.get("type") == "object"
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _list_type(validator, list_type, instance, schema) -> Iterator[jsonschema.ValidationError]:
    """x-kubernetes-list-type: `set` items and `map` keys must be unique, as the API server checks."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate item {item!r} in a list of type set")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        item_props = schema.get("items", {}).get("properties", {})
        seen = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            # A key left out takes its schema default (e.g. a port's protocol is TCP).
            ident = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
            if ident in seen:
                yield jsonschema.ValidationError(f"duplicate entry {dict(zip(keys, ident))} in a list keyed by {keys}")
            seen.add(ident)


def _nullable_type(validator, types, instance, schema) -> Iterator[jsonschema.ValidationError]:
    if instance is None and schema.get("nullable"):
        return
    yield from jsonschema.Draft7Validator.VALIDATORS["type"](validator, types, instance, schema)


_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("int32")
def _int32(value: Any) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value: Any) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


_KubeValidator = jsonschema.validators.extend(
    jsonschema.Draft7Validator,
    {"x-kubernetes-list-type": _list_type, "type": _nullable_type},
)


# The CRDs are megabytes of YAML: parse each once, with libyaml when it is there.
_YamlLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@lru_cache(maxsize=None)
def _crd_version(kind: str) -> dict:
    crd = yaml.load((CRD_DIR / CRD_FILES[kind]).read_text(), Loader=_YamlLoader)
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version


@lru_cache(maxsize=None)
def validator_for(kind: str) -> jsonschema.protocols.Validator:
    # _strict builds new dicts all the way down, so the cached CRD itself stays as written.
    schema = _strict(_crd_version(kind)["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": kind}
    # status is written by the operator; a manifest that sets it is wrong.
    schema["properties"].pop("status", None)
    return _KubeValidator(schema, format_checker=_FORMATS)


def schema_errors(doc: dict) -> list[str]:
    kind = doc.get("kind")
    if kind not in CRD_FILES:
        return [f"no KubeRay schema for kind {kind!r}"]
    errors = sorted(validator_for(kind).iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


def _manifest_files() -> list[Path]:
    return sorted(p for p in KUBERAY_DIR.iterdir() if p.suffix in {".yaml", ".yml"})


def _docs(kinds: set[str] | None = None) -> list[tuple[str, dict]]:
    out = []
    for path in _manifest_files():
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is None:
                continue
            if kinds is None or doc.get("kind") in kinds:
                out.append((f"{path.name}#{i}:{doc.get('kind')}", doc))
    return out


RAY_DOCS = _docs({"RayJob", "RayCluster"})
RAY_IDS = [name for name, _ in RAY_DOCS]


def cluster_spec(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def pod_templates(doc: dict) -> dict[str, dict]:
    spec = cluster_spec(doc)
    groups = {"head": spec["headGroupSpec"]["template"]}
    for group in spec.get("workerGroupSpecs", []):
        groups[group["groupName"]] = group["template"]
    return groups


def ray_container(template: dict) -> dict:
    # KubeRay runs Ray in the first container of the pod.
    return template["spec"]["containers"][0]


def locked_version(package: str) -> str:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    (version,) = {p["version"] for p in lock["package"] if p["name"] == package}
    return version


# --- every manifest is accounted for -------------------------------------------------------


def test_every_manifest_has_a_known_kind():
    files = _manifest_files()
    assert {p.name for p in files} >= {"rayjob.yaml", "raycluster.yaml", "storage.yaml"}
    for name, doc in _docs():
        assert doc.get("kind") in {"RayJob", "RayCluster", "PersistentVolumeClaim"}, (
            f"{name}: no check covers kind {doc.get('kind')!r}; add one to this test"
        )


# --- schema validation ---------------------------------------------------------------------


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_manifest_validates_against_the_kuberay_crd(doc):
    assert schema_errors(doc) == []


def _cel_guarded_paths(schema: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(schema, dict):
        if "x-kubernetes-validations" in schema:
            yield path
        for name, sub in schema.get("properties", {}).items():
            yield from _cel_guarded_paths(sub, path + (name,))
        if "items" in schema:
            yield from _cel_guarded_paths(schema["items"], path + ("*",))
        if isinstance(schema.get("additionalProperties"), dict):
            yield from _cel_guarded_paths(schema["additionalProperties"], path + ("*",))


def _present(doc: Any, path: tuple) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == "*":
        items = doc if isinstance(doc, list) else list(doc.values()) if isinstance(doc, dict) else []
        return any(_present(item, rest) for item in items)
    return isinstance(doc, dict) and head in doc and _present(doc[head], rest)


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_manifest_sets_no_field_guarded_by_cel_rules(doc):
    # jsonschema cannot evaluate the CRD's CEL rules (x-kubernetes-validations), so the manifests
    # stay off the fields they guard; using one needs a test that checks its rule by hand.
    schema = _crd_version(doc["kind"])["schema"]["openAPIV3Schema"]
    used = [p for p in _cel_guarded_paths(schema) if _present(doc, p)]
    assert used == []


# --- the validator is strict enough to fail ------------------------------------------------


def _broken(mutate) -> dict:
    (doc,) = [d for _, d in RAY_DOCS if d["kind"] == "RayJob"]
    doc = copy.deepcopy(doc)
    mutate(doc)
    return doc


def _trainer(doc: dict) -> dict:
    return cluster_spec(doc)["workerGroupSpecs"][0]


@pytest.mark.parametrize(
    "mutate, expected",
    [
        pytest.param(
            lambda d: ray_container(_trainer(d)["template"]).update(imagePullPolicyy="Always"),
            "imagePullPolicyy",
            id="unknown-container-field",
        ),
        pytest.param(
            lambda d: d["spec"].update(shutdownAfterJobFinish=True),
            "shutdownAfterJobFinish",
            id="misspelt-rayjob-field",
        ),
        pytest.param(lambda d: _trainer(d).update(replicas="two"), "'two' is not of type", id="wrong-type"),
        pytest.param(lambda d: _trainer(d).pop("groupName"), "'groupName' is a required", id="missing-required"),
        pytest.param(
            lambda d: ray_container(_trainer(d)["template"])["resources"]["limits"].update(memory="64 GB"),
            "does not match",
            id="bad-quantity",
        ),
        pytest.param(
            lambda d: _trainer(d)["template"]["spec"]["containers"].append(
                copy.deepcopy(ray_container(_trainer(d)["template"]))
            ),
            "duplicate entry",
            id="duplicate-container-name",
        ),
        pytest.param(lambda d: _trainer(d).update(replicas=2**31), "int32", id="int32-overflow"),
        pytest.param(lambda d: d["metadata"].update(name="RLcore_job"), "does not match", id="bad-name"),
        pytest.param(lambda d: d.update(apiVersion="ray.io/v1alpha1"), "ray.io/v1", id="old-api-version"),
        pytest.param(lambda d: d.update(status={"jobStatus": "RUNNING"}), "status", id="sets-status"),
    ],
)
def test_broken_manifest_fails_validation(mutate, expected):
    errors = schema_errors(_broken(mutate))
    assert errors, "the broken manifest passed validation"
    assert any(expected in e for e in errors), errors


def test_the_schema_check_does_not_mutate_the_manifest_it_was_given():
    (doc,) = [d for _, d in RAY_DOCS if d["kind"] == "RayJob"]
    before = copy.deepcopy(doc)
    schema_errors(doc)
    assert doc == before


# --- what the manifests say about running rlcore -------------------------------------------


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_every_pod_runs_the_one_pinned_image(doc):
    images = {name: ray_container(t)["image"] for name, t in pod_templates(doc).items()}
    assert len(set(images.values())) == 1, f"groups run different images: {images}"
    image = next(iter(images.values()))
    name, _, tag = image.rpartition(":")
    assert name and "/" not in tag, f"image {image!r} has no tag"
    assert tag != "latest", f"image {image!r} is not pinned"
    assert "." in image.split("/")[0], f"image {image!r} names no registry"


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_ray_version_matches_the_lock(doc):
    assert cluster_spec(doc)["rayVersion"] == locked_version("ray")


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_gpu_worker_groups_for_trainer_and_rollout(doc):
    spec = cluster_spec(doc)
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert {"trainer", "rollout"} <= set(groups)
    for name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        res = ray_container(group["template"])["resources"]
        gpus = res["limits"].get("nvidia.com/gpu")
        assert gpus is not None and int(gpus) > 0, f"worker group {name} asks for no GPU"
        assert res["requests"].get("nvidia.com/gpu") == gpus, f"{name}: GPU request != limit"
    head = ray_container(spec["headGroupSpec"]["template"])["resources"]
    assert "nvidia.com/gpu" not in head.get("limits", {}), "the head should not hold GPUs"
    assert spec["headGroupSpec"]["rayStartParams"].get("num-cpus") == "0"


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_every_pod_is_guaranteed_qos(doc):
    # Requests equal to limits for CPU and memory: the kubelet evicts such pods last, and one
    # evicted rank ends the whole run.
    for name, template in pod_templates(doc).items():
        for container in template["spec"]["containers"]:
            res = container["resources"]
            for key in ("cpu", "memory"):
                assert key in res["limits"], f"{name}/{container['name']}: no {key} limit"
                assert res["requests"].get(key) == res["limits"][key], f"{name}: {key} request != limit"


def _storage_claims() -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in _docs({"PersistentVolumeClaim"})}


def test_shared_storage_claim_is_read_write_many():
    claims = _storage_claims()
    assert SHARED_CLAIM in claims
    spec = claims[SHARED_CLAIM]["spec"]
    assert spec["accessModes"] == ["ReadWriteMany"], "trainer ranks on several nodes write one checkpoint"
    assert re.fullmatch(r"[0-9]+(Ki|Mi|Gi|Ti|Pi)", spec["resources"]["requests"]["storage"])


def _shared_mount(template: dict) -> str:
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    paths = [
        m["mountPath"]
        for m in ray_container(template).get("volumeMounts", [])
        if volumes.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName") == SHARED_CLAIM
    ]
    assert len(paths) == 1, f"expected one mount of {SHARED_CLAIM}, got {paths}"
    return paths[0]


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_every_pod_mounts_the_shared_claim_and_a_memory_shm(doc):
    mounts = {name: _shared_mount(t) for name, t in pod_templates(doc).items()}
    assert len(set(mounts.values())) == 1, f"groups mount the shared claim at different paths: {mounts}"
    for name, template in pod_templates(doc).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        shm = [m for m in ray_container(template)["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1, f"{name}: no /dev/shm mount"
        assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory", name


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_pods_run_as_the_image_user_with_a_writable_volume(doc):
    for name, template in pod_templates(doc).items():
        security = template["spec"]["securityContext"]
        assert security["runAsUser"] != 0, name
        assert security["fsGroup"] == security["runAsGroup"], name


def _rayjobs() -> list[dict]:
    return [d for _, d in RAY_DOCS if d["kind"] == "RayJob"]


def test_rayjob_runs_a_recipe_into_the_shared_storage_and_cleans_up():
    (job,) = _rayjobs()
    spec = job["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "rlcore.run"]
    overrides = dict(a.split("=", 1) for a in argv[3:])
    recipe = overrides["+recipe"]
    assert (REPO / "recipes" / f"{recipe}.yaml").is_file(), f"the RayJob runs unknown recipe {recipe!r}"
    mount = _shared_mount(cluster_spec(job)["headGroupSpec"]["template"])
    assert overrides["output_dir"].startswith(mount.rstrip("/") + "/"), (
        "output_dir must be on the shared volume, or checkpoints die with the pods"
    )
    assert spec["shutdownAfterJobFinishes"] is True
    assert spec["activeDeadlineSeconds"] > 0
    assert spec.get("backoffLimit", 0) == 0


def test_raycluster_is_long_lived():
    clusters = [d for _, d in RAY_DOCS if d["kind"] == "RayCluster"]
    assert len(clusters) == 1
    spec = clusters[0]["spec"]
    assert "shutdownAfterJobFinishes" not in spec
    head_ports = {p["name"]: p["containerPort"] for p in ray_container(spec["headGroupSpec"]["template"])["ports"]}
    assert head_ports.get("dashboard") == 8265, "launch.submit talks to the dashboard port"


@pytest.mark.parametrize("doc", [d for _, d in RAY_DOCS], ids=RAY_IDS)
def test_every_cluster_runs_with_token_authentication(doc):
    # Ray's default for clusters it starts; KubeRay's authOptions keeps the token in a Secret
    assert cluster_spec(doc).get("authOptions") == {"mode": "token"}
