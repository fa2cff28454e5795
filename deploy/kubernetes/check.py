"""What the Kubernetes schemas cannot say about deploy/kubernetes (scripts/check-deploy.sh
runs this after kubernetes-validate): the manifests run what docker-compose.yml runs,
with the same settings; every name they refer to exists; every container has its
probes and resources; the load-test Job's parts add up.

Usage: check.py COMPOSE_RENDERED.yml RENDERED_DIR (one <kustomization>.yaml per
kustomization, as `kubectl kustomize` printed it).
"""

import os
import re
import sys
from urllib.parse import urlsplit

import yaml

compose_path, rendered = sys.argv[1], sys.argv[2]
errors = []


def fail(message):
    errors.append(message)


def load(name):
    with open(os.path.join(rendered, f"{name}.yaml")) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def find(docs, kind, name):
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    return None


def containers(doc):
    spec = doc.get("spec", {})
    pod = spec.get("jobTemplate", {}).get("spec", spec).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def config_data(doc):
    """A ConfigMap's or Secret's keys and values (stringData as written)."""
    return {**(doc.get("data") or {}), **(doc.get("stringData") or {})}


def environment(docs, container):
    """The container's environment as the kubelet builds it: envFrom, then env, with
    $(VAR) expanded; a value from the downward API reads as {fieldPath}."""
    env = {}
    for source in container.get("envFrom", []):
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key in source:
                doc = find(docs, kind, source[key]["name"])
                env.update(config_data(doc) if doc else {})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = "{" + var["valueFrom"]["fieldRef"]["fieldPath"] + "}"
        else:
            env[var["name"]] = "<from " + ", ".join(var.get("valueFrom", {})) + ">"
    return env


def references(doc):
    """(kind, name) of every ConfigMap and Secret the workload's containers read."""
    for container in containers(doc):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                yield "ConfigMap", source["configMapRef"]["name"]
            if "secretRef" in source:
                yield "Secret", source["secretRef"]["name"]
        for var in container.get("env", []):
            value_from = var.get("valueFrom", {})
            if "configMapKeyRef" in value_from:
                ref = value_from["configMapKeyRef"]
                yield "ConfigMap", ref["name"], ref["key"]
            if "secretKeyRef" in value_from:
                ref = value_from["secretKeyRef"]
                yield "Secret", ref["name"], ref["key"]


WORKLOADS = ("Deployment", "StatefulSet", "Job")

compose = yaml.safe_load(open(compose_path))["services"]
lab, managed, loadtest = load("overlays-lab"), load("overlays-managed"), load("loadtest")

# 1. Every workload: resources requested and bounded, probes on long-running containers.
for name, docs in (("overlays/lab", lab), ("overlays/managed", managed), ("loadtest", loadtest)):
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        what = f"{name}: {doc['kind']} {doc['metadata']['name']}"
        for container in containers(doc):
            resources = container.get("resources", {})
            if not {"cpu", "memory"} <= set(resources.get("requests", {})):
                fail(f"{what}: container {container['name']} requests no cpu and memory")
            if "memory" not in resources.get("limits", {}):
                fail(f"{what}: container {container['name']} has no memory limit")
            if doc["kind"] != "Job":
                for probe in ("readinessProbe", "livenessProbe"):
                    if probe not in container:
                        fail(f"{what}: container {container['name']} has no {probe}")

# 2. Every ConfigMap and Secret a workload reads exists in what is applied with it. The
#    load test is applied beside an overlay; only its doors-open ConfigMap is made by
#    hand, just before (README, "On a cluster").
EXTERNAL = {("ConfigMap", "flashsale-loadtest")}
for name, docs in (("overlays/lab", lab + loadtest), ("overlays/managed", managed + loadtest)):
    for doc in docs:
        if doc["kind"] not in WORKLOADS:
            continue
        for ref in references(doc):
            kind, ref_name = ref[0], ref[1]
            if (kind, ref_name) in EXTERNAL:
                continue
            target = find(docs, kind, ref_name)
            if target is None:
                fail(f"{name}: {doc['kind']} {doc['metadata']['name']} reads {kind} {ref_name}, which is not there")
            elif len(ref) == 3 and ref[2] not in config_data(target):
                fail(f"{name}: {doc['kind']} {doc['metadata']['name']} reads key {ref[2]} of {kind} {ref_name}, which has none")

# 3. The replicas run what compose's run, with the same settings.
compose_replica = next(s for s in compose.values() if (s.get("command") or [])[:2] == ["flashsale", "serve"])
compose_env = {k: str(v) for k, v in (compose_replica.get("environment") or {}).items()}
BACKENDS = {"FLASHSALE_REDIS_URL", "FLASHSALE_REDLOCK_URLS", "FLASHSALE_DATABASE_URL",
            "FLASHSALE_ZOOKEEPER", "FLASHSALE_ETCD", "FLASHSALE_REDIS_SENTINEL"}
PER_REPLICA = {"FLASHSALE_REPLICA_ID", "FLASHSALE_ADVERTISE", "FLASHSALE_ADMIN_TOKEN"}
KUBERNETES_ONLY = {"FLASHSALE_REPORT_DIR": "the root filesystem is read-only", "POD_NAME": "", "POD_IP": ""}


def endpoints(value):
    """scheme and port of each address in a URL list or host:port list."""
    result = []
    for item in value.split(","):
        url = urlsplit(item if "://" in item else "//" + item)
        result.append((url.scheme, url.port, url.path))
    return result


for name, docs in (("overlays/lab", lab), ("overlays/managed", managed)):
    deployment = find(docs, "Deployment", "flashsale")
    if deployment is None:
        fail(f"{name}: no Deployment flashsale")
        continue
    container = containers(deployment)[0]
    if container.get("image") != compose_replica.get("image"):
        fail(f"{name}: the replicas run {container.get('image')}, compose's {compose_replica.get('image')}")
    if container.get("command") != compose_replica["command"]:
        fail(f"{name}: the replicas run {container.get('command')}, compose's {compose_replica['command']}")
    env = environment(docs, container)
    for key, value in compose_env.items():
        if key in PER_REPLICA:
            continue
        if key not in env:
            fail(f"{name}: the replicas have no {key} (compose: {value})")
        elif key in BACKENDS:
            if name.endswith("lab") and [e[::2] for e in endpoints(env[key])] != [e[::2] for e in endpoints(value)]:
                fail(f"{name}: {key}={env[key]} is not compose's {value} (scheme, path)")
        elif env[key] != value:
            fail(f"{name}: {key}={env[key]}, compose has {value}")
    for key in sorted(set(env) - set(compose_env) - set(KUBERNETES_ONLY)):
        fail(f"{name}: the replicas set {key}, which compose's do not")
    if env.get("FLASHSALE_ADVERTISE") != "{status.podIP}:8080":
        fail(f"{name}: FLASHSALE_ADVERTISE is {env.get('FLASHSALE_ADVERTISE')}, not the pod's IP and port")
    if env.get("FLASHSALE_REPLICA_ID") != "{metadata.name}":
        fail(f"{name}: FLASHSALE_REPLICA_ID is {env.get('FLASHSALE_REPLICA_ID')}, not the pod's name")
    if env.get("FLASHSALE_ADMIN_TOKEN") != "<from secretKeyRef>":
        fail(f"{name}: the admin token does not come from a Secret")
    admin = find(docs, "Secret", "flashsale-admin")
    if admin and config_data(admin).get("token"):
        fail(f"{name}: the admin Secret ships a token; nothing may start with one not chosen")
    # Ready means "takes orders", alive means "serves": neither follows the shared
    # backends (/healthz), or one outage would empty the Service (src/http/health.rs).
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/livez")):
        if container.get(probe, {}).get("httpGet", {}).get("path") != path:
            fail(f"{name}: the replicas' {probe} does not ask {path}")
    if name.endswith("managed") and any(d["kind"] == "StatefulSet" for d in docs):
        fail("overlays/managed runs StatefulSets: it is for backends run elsewhere")

# 4. The lab's backends are compose's: the same images and settings, and the replicas'
#    addresses lead to them (host = <service> or <pod>.<service>, on a port it serves).
SAME_AS_COMPOSE = {"redis": "redis", "mariadb": "mariadb", "zookeeper": "zookeeper", "etcd": "etcd"}
for statefulset, service in SAME_AS_COMPOSE.items():
    doc = find(lab, "StatefulSet", statefulset)
    if doc is None:
        fail(f"overlays/lab: no StatefulSet {statefulset}")
        continue
    container = containers(doc)[0]
    theirs = compose[service]
    if container["image"] != theirs["image"]:
        fail(f"overlays/lab: {statefulset} runs {container['image']}, compose {theirs['image']}")
    # compose's command is the image's command (etcd, redis) or its arguments
    # (mariadb); etcd's peer address is its pod IP here, its service name there.
    command = container.get("command") or container.get("args") or []
    command = [c.replace("$(POD_IP)", service) for c in command]
    if command != (theirs.get("command") or []):
        fail(f"overlays/lab: {statefulset} runs {command}, compose {theirs.get('command')}")
    env = environment(lab, container)
    for key, value in (theirs.get("environment") or {}).items():
        if str(env.get(key)) != str(value):
            fail(f"overlays/lab: {statefulset} has {key}={env.get(key)}, compose {value}")
    if doc["spec"].get("serviceName") != statefulset or find(lab, "Service", statefulset) is None:
        fail(f"overlays/lab: StatefulSet {statefulset} has no governing Service of its name")

replicas_env = environment(lab, containers(find(lab, "Deployment", "flashsale"))[0])


def reachable(host, port):
    first, _, rest = host.partition(".")
    service = find(lab, "Service", rest or first)
    if service is None or port not in [p["port"] for p in service["spec"]["ports"]]:
        return False
    if not rest:
        return True
    statefulset = find(lab, "StatefulSet", rest)
    match = re.fullmatch(re.escape(rest) + r"-(\d+)", first)
    return bool(statefulset and match and int(match.group(1)) < statefulset["spec"]["replicas"])


for key in sorted(BACKENDS):
    for item in replicas_env.get(key, "").split(","):
        url = urlsplit(item if "://" in item else "//" + item)
        if not reachable(url.hostname or "", url.port):
            fail(f"overlays/lab: {key} names {url.hostname}:{url.port}, which no Service or StatefulSet pod serves")
redlock = replicas_env.get("FLASHSALE_REDLOCK_URLS", "").split(",")
if len(set(redlock)) != 3:
    fail(f"overlays/lab: Redlock needs three distinct Redis nodes, has {redlock}")
mariadb_env = environment(lab, containers(find(lab, "StatefulSet", "mariadb"))[0])
database = urlsplit(replicas_env.get("FLASHSALE_DATABASE_URL", ""))
if (database.username, database.password, database.path.strip("/")) != (
    mariadb_env.get("MARIADB_USER"), mariadb_env.get("MARIADB_PASSWORD"), mariadb_env.get("MARIADB_DATABASE")
):
    fail("overlays/lab: the replicas' database URL does not match MariaDB's user, password and database")

# 5. The load test: an indexed Job whose pods are the parts, on the replicas' Service.
job = next((d for d in loadtest if d["kind"] == "Job"), None)
if job is None:
    fail("loadtest: no Job")
else:
    spec = job["spec"]
    container = containers(job)[0]
    env = environment(loadtest, container)
    script = " ".join(container.get("command", []) + container.get("args", []))
    parts = env.get("PARTS")
    if spec.get("completionMode") != "Indexed":
        fail("loadtest: the Job is not Indexed: its pods cannot tell which part they play")
    if not (str(spec.get("parallelism")) == str(spec.get("completions")) == str(parts)):
        fail(f"loadtest: parallelism {spec.get('parallelism')}, completions {spec.get('completions')} and PARTS {parts} differ: the parts must run at once, each once")
    if "--part" not in script or "JOB_COMPLETION_INDEX" not in script:
        fail("loadtest: the Job's pods do not pass --part from their completion index")
    if spec.get("backoffLimit") != 0:
        fail("loadtest: a retried part would come after its sales: backoffLimit must be 0")
    if container.get("image") != compose["loadtest"].get("image"):
        fail(f"loadtest: runs {container.get('image')}, compose's loadtest {compose['loadtest'].get('image')}")
    for target in re.findall(r"--targets[= ](\S+)", script):
        for url in target.strip("'\"").split(","):
            host = urlsplit(url).hostname
            if find(lab, "Service", host) is None:
                fail(f"loadtest: target {url} is no Service of the lab")
    if env.get("FLASHSALE_DOORS_OPEN") != "<from configMapKeyRef>":
        fail("loadtest: the doors-open moment does not come from the flashsale-loadtest ConfigMap")

for message in errors:
    print(f"[check-deploy] {message}", file=sys.stderr)
if errors:
    sys.exit(1)
workloads = sum(d["kind"] in WORKLOADS for d in lab + managed + loadtest)
print(f"[check-deploy] deploy/kubernetes: {workloads} workloads match docker-compose.yml, "
      "every reference resolves", file=sys.stderr)
