"""A small kustomize: renders deploy/k8s without kubectl, for the features deploy/k8s uses.

Supported kustomization fields: ``resources`` (files and folders with a kustomization),
``components`` (folders with a ``kind: Component`` kustomization),
``patches`` (strategic-merge patch files, several documents each, ``$patch: delete``),
``images`` (``newName``, ``newTag``) and ``namespace``. Anything else raises, so a manifest that
starts using another feature fails here instead of rendering differently from kustomize;
tests/deploy/test_kubernetes.py compares this renderer with ``kubectl kustomize`` where kubectl
is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

FIELDS = {"apiVersion", "kind", "namespace", "resources", "components", "patches", "images"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding"}
# strategic-merge keys of the lists deploy/k8s patches (k8s.io/api patchMergeKey tags); other lists are replaced
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}


def load_documents(path: Path) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(folder: Path, parent: list[Obj] | None = None) -> list[Obj]:
    """The objects of the kustomization in ``folder``; a Component (``parent``: the objects of the
    kustomization that lists it) adds its resources to the parent's and patches them all, as
    kustomize applies components after the parent's resources and before its own patches."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - FIELDS
    if unknown:
        raise NotImplementedError(
            f"{folder}: kustomization fields {sorted(unknown)} are not supported by this renderer"
        )
    if (spec.get("kind") == "Component") != (parent is not None):
        raise ValueError(f"{folder}: a kind: Component kustomization goes under components:, and only there")
    objects: list[Obj] = list(parent or [])
    for entry in spec.get("resources", []):
        path = folder / entry
        objects += render(path) if path.is_dir() else load_documents(path)
    for entry in spec.get("components", []):
        objects = render(folder / entry, objects)
    for entry in spec.get("patches", []):
        if set(entry) != {"path"}:
            raise NotImplementedError(f"{folder}: only `patches: - path: FILE` is supported, got {entry}")
        for patch in load_documents(folder / entry["path"]):
            objects = apply_patch(objects, patch)
    for image in spec.get("images", []):
        set_image(objects, image)
    if "namespace" in spec:
        set_namespace(objects, spec["namespace"])
    return objects


def key(obj: Obj) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def apply_patch(objects: list[Obj], patch: Obj) -> list[Obj]:
    matches = [
        i for i, obj in enumerate(objects) if key(obj) == key(patch) and obj["apiVersion"] == patch["apiVersion"]
    ]
    if len(matches) != 1:
        raise ValueError(f"patch {key(patch)} matches {len(matches)} resources")
    (i,) = matches
    if patch.get("$patch") == "delete":
        return objects[:i] + objects[i + 1 :]
    return objects[:i] + [merge(objects[i], patch)] + objects[i + 1 :]


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of ``patch`` into ``base``: maps merge, lists with a merge key merge by it
    (items the base lacks go first, as ``kubectl kustomize`` orders them), other lists and
    scalars are replaced, ``null`` deletes."""
    if isinstance(patch, dict) and isinstance(base, dict):
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(patch, list) and isinstance(base, list) and field in MERGE_KEYS:
        merge_key = MERGE_KEYS[field]
        out = list(base)
        added = []
        for item in patch:
            at = next((i for i, old in enumerate(out) if old[merge_key] == item[merge_key]), None)
            if at is None:
                added.append(copy.deepcopy(item))
            else:
                out = out[:at] + [merge(out[at], item)] + out[at + 1 :]
        return added + out  # kustomize puts the items new to the list first
    return copy.deepcopy(patch)


def pod_specs(obj: Obj) -> list[Obj]:
    template = obj.get("spec", {}).get("template")
    return [template["spec"]] if template else []


def set_image(objects: list[Obj], image: Obj) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise NotImplementedError(f"images: only name, newName and newTag are supported, got {image}")
    for obj in objects:
        for pod in pod_specs(obj):
            for container in pod.get("containers", []) + pod.get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def set_namespace(objects: list[Obj], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] == "Namespace":
            obj["metadata"]["name"] = namespace  # as kustomize does
        elif obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
